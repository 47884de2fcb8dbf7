"""The systems of a `type: lm_eval` compare as lm-eval models, and the merges they need, built on disk and cached.

Each is a `mergecompose.experiments.scored_systems.System` whose `load` is an `LmEvalModel` (lm-eval's model name and
its `model_args`) and whose `identity` keys its cached cells:

    base, expert:<name>   lm-eval's `hf` model (a peft adapter: `hf` with `peft=`, on the base)
    <composition>         our `composed` model (`mergecompose.integrations.lm_eval.harness_model`)
    merge:<method>        `hf` on a merge in the run's cache: mergekit's (`mergecompose.merging.merge_checkpoints`),
                          or with `merge_definitions: paper` the papers' (`mergecompose.merging.merge`, as
                          `mergecompose compare` does)

Merges and LoRA experts made dense live in `CACHE/` under a hash of their inputs (the method,
its parameters, the dtype, the seed, and each source: a hub id, or a local folder's files with
their sizes and modification times); a folder under its final name is complete (it is written
beside it and renamed). A LoRA expert is merged from its ΔW: `TaskVector.from_lora` applied to
the base and saved as a full checkpoint with the base's tokenizer, which mergekit then merges
like any other checkpoint.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import lm_eval.api.registry
from transformers import AutoModelForCausalLM, AutoTokenizer

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers lm-eval's `composed` model)
from mergecompose.composition.loading import is_adapter_source
from mergecompose.core.boundary import check_checkpoint
from mergecompose.core.import_paths import is_import_path, source_hash
from mergecompose.core.io import atomic_output_dir, manifest_problem, write_manifest
from mergecompose.core.precision import DTYPES
from mergecompose.experiments.compare_config import fingerprint
from mergecompose.experiments.lm_eval.lm_eval_config import LmEvalCompareConfig
from mergecompose.experiments.scored_systems import BASE, System, expert_name
from mergecompose.merging import TaskVector, merge, merge_checkpoints


@dataclass(frozen=True)
class LmEvalModel:
    """lm-eval's model `model` ("hf" or "composed") with its `model_args`; calling it builds the model."""

    model: str
    model_args: dict

    def __call__(self):
        return lm_eval.api.registry.get_model(self.model).create_from_arg_obj(dict(self.model_args), {})


def slug(name: str) -> str:
    """`name` as a file name: characters other than letters, digits, `.`, `+`, `-` and `=` become `_`."""
    return re.sub(r"[^\w.+=-]", "_", name)


def source_identity(source: str) -> dict:
    """A local folder's resolved path and files (name, size, mtime), or a hub id: what a cached result depends on."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(
            (item.name, item.stat().st_size, item.stat().st_mtime_ns) for item in path.iterdir() if item.is_file()
        )
        return {"folder": str(path.resolve()), "files": files}
    return {"hub": source}


def hf_system(
    name: str, config: LmEvalCompareConfig, pretrained: str, peft: str | None = None, identity: dict | None = None
) -> System:
    args = {"pretrained": pretrained, "dtype": config.dtype, "device": config.device, "batch_size": config.batch_size}
    if peft is not None:
        args["peft"] = peft
    if identity is None:
        identity = {"pretrained": source_identity(pretrained), "peft": source_identity(peft) if peft else None}
    settings = {key: value for key, value in args.items() if key not in ("pretrained", "peft")}  # paths: in `identity`
    return System(name, LmEvalModel("hf", args), {**settings, **identity})


def single_systems(config: LmEvalCompareConfig) -> dict[str, System]:
    """`base` and every `expert:<name>` (an adapter is scored on the base, as peft runs it).

    The base's and the experts' files are checked first (`mergecompose.core.boundary`), before lm-eval loads any.
    """
    check_checkpoint(config.base, "base", adapter_hint="give its base as `base` and the adapter under `experts`")
    systems = {BASE: hf_system(BASE, config, config.base)}
    for name, source in config.experts.items():
        if is_adapter_source(source, f"experts.{name}"):
            systems[expert_name(name)] = hf_system(
                expert_name(name),
                config,
                config.base,
                peft=source,
                identity={"pretrained": source_identity(config.base), "peft": source_identity(source)},
            )
        else:
            systems[expert_name(name)] = hf_system(expert_name(name), config, source)
    return systems


def composition_systems(config: LmEvalCompareConfig) -> dict[str, System]:
    """Each composition as lm-eval's `composed` model (experts as folders or hub ids, `|`-free lists)."""
    systems = {}
    for name, composition in config.compositions.items():
        args = {
            "base": config.base,
            "experts": [config.experts[expert] for expert in composition.experts],
            "dtype": config.dtype,
            "device": config.device,
            "batch_size": config.batch_size,
        }
        if composition.weights is not None:
            args["weights"] = list(composition.weights)
        if composition.remedies is not None:  # RemedySettings.parse's string form
            args["remedies"] = composition.remedies.as_model_args()
        identity = {
            "base": source_identity(config.base),
            "experts": [source_identity(path) for path in args["experts"]],
        }
        if composition.remedies is not None and composition.remedies.custom:  # their code's hashes, for the cache
            identity["remedies"] = composition.remedies.model_dump(mode="json")["custom"]
        systems[name] = System(name, LmEvalModel("composed", args), {**args, **identity})
    return systems


@dataclass(frozen=True)
class MergeBuild:
    """One merge (a method at one grid point) and where it is, or will be, on disk."""

    method: str
    params: dict
    key: str
    folder: Path

    def system(self, name: str, config: LmEvalCompareConfig) -> System:
        # Keyed by the merge's inputs, so a cached cell needs no rebuilt merge.
        return hf_system(name, config, str(self.folder), identity={"merge": self.key})


def plan_merge(config: LmEvalCompareConfig, method: str, params: dict, cache: Path) -> MergeBuild:
    """Where the merge of `config.merged_experts()` with `method` at `params` goes (nothing is built)."""
    sources = [config.base, *(config.experts[name] for name in config.merged_experts())]
    key = fingerprint(
        {
            "method": method,
            "params": params,
            "dtype": config.dtype,
            "seed": config.seed_merges,
            "sources": [source_identity(source) for source in sources],
            **({"definitions": config.merge_definitions} if config.merge_definitions != "mergekit" else {}),
            **({"user_code": source_hash(method)} if is_import_path(method) else {}),
        }
    )
    return MergeBuild(method, dict(params), key, cache / f"merge-{slug(method)}-{key}")


def build_merge(config: LmEvalCompareConfig, build: MergeBuild, cache: Path) -> Path:
    """The merged checkpoint folder of `build` (mergekit, or in memory for the papers' definitions and a user's own
    method; LoRA experts made dense first), built unless cached."""
    if _reusable(build.folder):
        return build.folder
    experts = {name: dense_checkpoint(config, name, cache) for name in config.merged_experts()}
    if config.merge_definitions == "paper" or is_import_path(build.method):
        _merge_in_memory(config, build, list(experts.values()))
    else:
        options = {"device": config.device} if config.device != "cpu" else None
        merge_checkpoints(
            config.merge_config(build.method, build.params, experts), build.folder, overwrite=True, options=options
        )
    write_manifest(build.folder)  # last: an entry without one (a run killed before this line) is built again
    return build.folder


def _reusable(folder: Path) -> bool:
    """Whether the cached checkpoint `folder` exists and agrees with its manifest; a damaged one is named in
    a warning (and then built again by the caller)."""
    if not folder.is_dir():
        return False
    problem = manifest_problem(folder)
    if problem is not None:
        warnings.warn(
            f"cached checkpoint {folder.name} cannot be reused ({problem}); building it again",
            UserWarning,
            stacklevel=2,
        )
    return problem is None


def _merge_in_memory(config: LmEvalCompareConfig, build: MergeBuild, experts: list[str]) -> None:
    """`mergecompose.merging.merge` with the papers' definitions (as `mergecompose compare` merges), or a user's own
    method, saved as a checkpoint with the base's tokenizer."""
    dtype = DTYPES[config.dtype]
    base = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype)
    models = [AutoModelForCausalLM.from_pretrained(expert, dtype=dtype) for expert in experts]
    state = merge(build.method, base, models, seed=config.seed_merges, progress=False, **build.params)
    with atomic_output_dir(build.folder, overwrite=True) as folder:
        base.load_state_dict(state)
        base.save_pretrained(folder)
        AutoTokenizer.from_pretrained(config.base).save_pretrained(str(folder))


def dense_checkpoint(config: LmEvalCompareConfig, name: str, cache: Path) -> str:
    """Expert `name` as a full checkpoint folder: itself, or for a LoRA adapter the base + ΔW with the base's
    tokenizer."""
    source = config.experts[name]
    if not is_adapter_source(source, f"experts.{name}"):
        return source
    key = fingerprint({"base": source_identity(config.base), "adapter": source_identity(source), "dtype": config.dtype})
    target = cache / f"dense-{slug(name)}-{key}"
    if not _reusable(target):
        with atomic_output_dir(target, overwrite=True) as folder:
            base = AutoModelForCausalLM.from_pretrained(config.base, dtype=DTYPES[config.dtype])
            base.load_state_dict(TaskVector.from_lora(base, source).apply_to(base.state_dict()))
            base.save_pretrained(folder)
            AutoTokenizer.from_pretrained(config.base).save_pretrained(str(folder))
            write_manifest(folder)
    return str(target)
