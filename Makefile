# Two entry points: `make run` (the main job on its built-in default) and `make test`.
# Both create ./.venv on first use. GPU users: see README, "Using your own torch".
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then $(BIN)/pip install --quiet "$(TORCH_SPEC)"; fi
	$(BIN)/pip install --quiet -e ".[test,lm-eval]"
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/mergecompose compare configs/letters.yaml --out runs/letters

test: $(VENV)/.installed
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q

.PHONY: install run test
