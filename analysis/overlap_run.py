"""`run_overlap`: load a base, its experts (checkpoints or adapters) and a merge, measure, write the report.

The typed config `OverlapRunConfig` is what `mergecompose overlap` builds from a YAML file
(`read_overlap_yaml`: relative paths in it are read from the YAML's own folder) and/or flags; the
resolved config is written next to the results as config.yaml. `preflight_overlap` checks everything
the run needs before any model loads; `run_overlap` calls it first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.analysis.data import encode_records, make_batches, prompt_batches, read_jsonl
from mergecompose.analysis.input_interference import input_interference
from mergecompose.analysis.measure import measure_overlap, rollout_batches
from mergecompose.analysis.overlap_report import write_outputs
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.own_prompts import own_prompt_statistics
from mergecompose.analysis.predict import (
    RULE_FILE,
    check_rule_diagnostics,
    load_rule,
    recommend,
    undefined_reasons,
    unlabelled_diagnostics,
)
from mergecompose.composition import ComposedLM
from mergecompose.composition.loading import is_adapter_source, names_from_paths
from mergecompose.core.adapters import merged_adapter_model
from mergecompose.core.boundary import check_checkpoint, check_model_or_adapter, check_tokenizer
from mergecompose.core.io import atomic_output_dir, read_yaml_mapping, refuse_existing, refuse_output_over_inputs
from mergecompose.core.sources import check_tokenizer_source
from mergecompose.merging import TaskVector, merge


class OverlapRunConfig(BaseModel):
    """One `mergecompose overlap` run.

    * `base`, `experts`: local folders or hub ids; each expert is a full checkpoint or a peft
      adapter (told apart by `adapter_config.json`).
    * `merged`: the task-arithmetic merge `θ_b + λΣτ_i` (checkpoint or adapter), optional.
    * `lam`: λ, the composition's exponent for every expert and the merge's scale. With λ ≠ 1
      each `θ_b + λτ_i` is built in memory (`mergecompose.merging.merge("task_arithmetic", ...)`) for the
      single-expert linearization error.
    * `data`: jsonl with `{"text"}` or `{"prompt", "completion"}` records; `tokenizer` defaults to
      the base's.
    * `max_length`: the most tokens a record may have (and at most the base's context,
      `max_position_embeddings`). A longer record is an error unless `truncate`: then it is cut,
      with a warning that says how many records and tokens were cut.
    * `rollouts`: also measure on greedy rollouts of "composed", "base", "experts" (each
      expert) or a named expert, from each record's prompt (or the first `prompt_tokens` tokens
      of a text record).
    * `parameter_density`: the TIES trim's kept share for the parameter-space measures;
      `parameter_measures: false` skips them.
    * `expert_data`: an expert's name → a jsonl of that expert's own prompts (records as in `data`): the
      expert's greedy rollouts from them (as `rollouts`), measured like the others, give its retention by the
      merge and the composition where it does its own task (`expert_data` in overlap.json).
    * `recommend`: also say whether to merge or compose (`mergecompose.analysis.predict`): the unlabelled
      diagnostics on the composition's own rollouts (measured even if `rollouts` omits
      "composed"), against the merge (`merged`, else the task-arithmetic merge at `lam` built in
      memory), read by the verdict rule `rule` (a predict_rule.json; default the one shipped).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    base: str
    experts: list[str] = Field(min_length=1)
    merged: str | None = None
    data: str
    out: str
    overwrite: bool = False
    tokenizer: str | None = None
    lam: float = Field(1.0, gt=0)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(256, ge=2)
    max_records: int | None = Field(None, ge=1)
    truncate: bool = False
    rollouts: list[str] = Field(default_factory=list)
    expert_data: dict[str, str] = Field(default_factory=dict)
    max_new_tokens: int = Field(32, ge=1)
    prompt_tokens: int = Field(8, ge=1)
    parameter_measures: bool = True
    parameter_density: float = Field(0.2, gt=0, le=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    settings: OverlapSettings = Field(default_factory=OverlapSettings)
    recommend: bool = False
    rule: str | None = None

    @field_validator("data")
    @classmethod
    def _data_exists(cls, value: str) -> str:
        if not Path(value).is_file():
            raise ValueError(f"`data` must be an existing .jsonl file, got {value!r}")
        return value

    @field_validator("expert_data")
    @classmethod
    def _expert_data_exist(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not Path(path).is_file():
                raise ValueError(f"`expert_data[{name!r}]` must be an existing .jsonl file, got {path!r}")
        return value

    @model_validator(mode="after")
    def _known_rollouts(self) -> OverlapRunConfig:
        if self.rule is not None and not self.recommend:
            raise ValueError(
                "`rule` is the verdict rule of `recommend`; set `recommend: true` (--recommend) or drop it"
            )
        if self.rule is not None and not Path(self.rule).is_file():
            raise ValueError(f"`rule` must be an existing predict_rule.json file, got {self.rule!r}")
        if self.recommend and not self.parameter_measures:
            raise ValueError("`recommend` reads the parameter-space measures too; drop `parameter_measures: false`")
        for source in self.rollouts:
            if source not in ("composed", "base", "experts") and not source.startswith("expert:"):
                raise ValueError(
                    f"`rollouts` entries must be 'composed', 'base', 'experts' or 'expert:<name>', got {source!r}"
                )
        return self


# The fields of `OverlapRunConfig` that name files or folders: model sources (a hub id stays as it is), and plain paths.
_SOURCE_FIELDS = ("base", "experts", "merged", "tokenizer")
_PATH_FIELDS = ("data", "out", "rule")


def read_overlap_yaml(path: str | os.PathLike) -> dict:
    """The mapping of an overlap `--config` YAML, its relative paths resolved against the YAML's own folder.

    `data`, `out` and `rule` are paths; `base`, `experts`, `merged` and `tokenizer` are resolved where they
    name a local path as seen from that folder (the rule of `mergecompose.core.sources.is_local`), kept as they are
    where they are hub ids (`owner/name`). Flags given beside `--config` are read from the working directory.
    """
    values = read_yaml_mapping(path, "`--config` overlap config")
    folder = Path(path).parent
    for name in _PATH_FIELDS:
        if isinstance(values.get(name), str):
            values[name] = str(_from_folder(folder, values[name]))
    if isinstance(values.get("expert_data"), dict):
        values["expert_data"] = {
            name: str(_from_folder(folder, path)) if isinstance(path, str) else path
            for name, path in values["expert_data"].items()
        }
    for name in _SOURCE_FIELDS:
        value = values.get(name)
        if isinstance(value, list):
            values[name] = [_source_from_folder(folder, item) for item in value]
        elif isinstance(value, str):
            values[name] = _source_from_folder(folder, value)
    return values


def _from_folder(folder: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else folder / path


def _source_from_folder(folder: Path, value: object) -> object:
    """A model source relative to `folder` where it is a local path seen from there; a hub id unchanged."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute() or value.startswith("~"):
        return str(path)
    candidate = folder / path
    local = candidate.exists() or value.startswith(".") or len(path.parts) > 2
    if local or (len(path.parts) == 2 and candidate.parent.is_dir()):
        return str(candidate)
    return value


def preflight_overlap(config: OverlapRunConfig) -> None:
    """Check everything `run_overlap` needs before its first step; load no model, write nothing.

    The output folder (not over an input, not existing unless `overwrite`); with `recommend`, the rule
    file (UTF-8 JSON, a `VerdictRule`) and every diagnostic it reads (one the overlap measures with
    `settings`); the data (a readable UTF-8 JSONL file of `{"text"}` or `{"prompt", "completion"}`
    records, at least one); `device`; the base, experts, merge and tokenizer through the loading
    boundary (`mergecompose.core.boundary`: folders, config.json, weight headers); the `rollouts`
    entries against the experts' names. The numeric settings are checked by `OverlapRunConfig` itself.
    What needs the tokenized records (their length against the base's context) is checked after the
    tokenizer loads, still before any measurement.
    """
    inputs = [config.base, *config.experts, config.merged, config.data, config.tokenizer, config.rule]
    inputs += list(config.expert_data.values())
    refuse_output_over_inputs(config.out, inputs, "`out`")
    refuse_existing(config.out, config.overwrite)
    if config.recommend:
        where = f"`rule` {config.rule!r}" if config.rule else f"the shipped rule ({RULE_FILE})"
        check_rule_diagnostics(load_rule(config.rule), config.settings, where)
    read_jsonl(config.data, config.max_records)  # UTF-8, JSON, records with the fields, at least one
    _device(config.device)
    check_checkpoint(config.base, "base")
    for expert in config.experts:
        check_model_or_adapter(expert, "experts")
    if config.merged is not None:
        check_model_or_adapter(config.merged, "merged")
    if config.tokenizer is not None:
        check_tokenizer(config.tokenizer, "tokenizer")
    names = names_from_paths(config.experts)
    _rollout_sources(config.rollouts, names)
    for name, path in config.expert_data.items():
        if name not in names:
            raise ValueError(f"`expert_data` names {name!r}, which is no expert; the experts are {names}")
        read_jsonl(path, config.max_records)


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("`device` is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return choice


def _load_causal_lm(source: str, base: str, device: str, argument: str = "merged"):
    """A full model from a checkpoint, or base + adapter merged (`merge_and_unload`, after checking that it fits)."""
    if is_adapter_source(source, argument):
        return merged_adapter_model(AutoModelForCausalLM.from_pretrained(base), source, argument).eval().to(device)
    return AutoModelForCausalLM.from_pretrained(source).eval().to(device)


def _task_vector(base_model, base: str, expert: str, device: str):
    """τ = θ_expert − θ_base: dense ΔW for an adapter, lazy per-tensor reads for local checkpoints."""
    if is_adapter_source(expert, "experts"):
        return TaskVector.from_lora(base_model, expert)
    if Path(base).is_dir() and Path(expert).is_dir():
        return TaskVector.from_checkpoints(base, expert)
    return TaskVector.from_models(base_model, _load_causal_lm(expert, base, device, "experts"))


def _rollout_sources(rollouts: list[str], expert_names: list[str]) -> list[str]:
    """The decoders `rollouts` asks for, each once: "composed", "base" or an expert's name (checked)."""
    sources = []
    for source in rollouts:
        if source == "experts":
            sources += expert_names
        elif source.startswith("expert:"):
            name = source.removeprefix("expert:")
            if name not in expert_names:
                raise ValueError(f"`rollouts` entry {source!r} names no expert; the experts are {expert_names}")
            sources.append(name)
        else:
            sources.append(source)
    return list(dict.fromkeys(sources))


def _check_rollout_room(prompts: list[dict], max_new_tokens: int, context: int | None, argument: str) -> None:
    """Refuse rollouts whose longest prompt plus `max_new_tokens` exceeds the base's context, naming `argument`."""
    longest = max((batch["input_ids"].shape[1] for batch in prompts), default=0)
    if prompts and context is not None and longest + max_new_tokens > context:
        raise ValueError(
            f"{argument}: prompts of up to {longest} tokens plus `max_new_tokens` = {max_new_tokens} exceed the "
            f"base's context of {context} positions (`max_position_embeddings`); lower `max_new_tokens`"
        )


def run_overlap(config: OverlapRunConfig, progress: bool = True) -> dict:
    """Measure and write overlap.json, overlap.md, config.yaml and the plots into `config.out`.

    The output folder is written atomically (a temporary folder next to it, then renamed); an
    existing one is refused unless `config.overwrite`. Returns the overlap.json content.
    """
    preflight_overlap(config)  # everything the last step needs, before the first model loads
    rule = load_rule(config.rule) if config.recommend else None
    records = read_jsonl(config.data, config.max_records)  # before any model loads: a bad file fails fast
    # The tokenizer too: loading it is quick, and a bad one should not cost loading every model first.
    tokenizer = (
        AutoTokenizer.from_pretrained(check_tokenizer_source(config.tokenizer, "tokenizer"))
        if config.tokenizer
        else None
    )
    device = _device(config.device)
    k = len(config.experts)
    composed = ComposedLM.from_pretrained(
        config.base, experts=config.experts, weights=[config.lam] * k, device_map=device
    )
    sources = _rollout_sources(config.rollouts + (["composed"] if config.recommend else []), composed.expert_names)
    tokenizer = tokenizer or composed.tokenizer
    if tokenizer is None:
        raise ValueError(f"no tokenizer found in `base` {config.base!r}; pass `tokenizer`")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; one is needed to pad batches")

    limit, limit_name, context = config.max_length, "`max_length`", composed.context_length
    if context is not None and context < limit:
        limit, limit_name = context, "the base's context, `max_position_embeddings`"
    encoded = encode_records(records, tokenizer, limit, truncate=config.truncate, limit_name=limit_name)
    batches = make_batches(encoded, config.batch_size, pad_id)
    prompts = prompt_batches(encoded, config.batch_size, pad_id, config.prompt_tokens) if sources else []
    _check_rollout_room(prompts, config.max_new_tokens, context, "`rollouts`")
    own_prompts = {}  # each expert's own prompts, tokenized and checked before any measurement
    for name, path in config.expert_data.items():
        own = encode_records(
            read_jsonl(path, config.max_records), tokenizer, limit, truncate=config.truncate, limit_name=limit_name
        )
        own_prompts[name] = prompt_batches(own, config.batch_size, pad_id, config.prompt_tokens)
        _check_rollout_room(own_prompts[name], config.max_new_tokens, context, f"`expert_data[{name!r}]`")

    base_model = None
    if config.parameter_measures or config.lam != 1.0:
        base_model = AutoModelForCausalLM.from_pretrained(config.base).eval().to(device)
    task_vectors = None
    if config.parameter_measures:
        task_vectors = {
            name: _task_vector(base_model, config.base, expert, device)
            for name, expert in zip(composed.expert_names, config.experts)
        }
    scaled = None
    if config.lam != 1.0:
        scaled = []
        for name, expert in zip(composed.expert_names, config.experts):
            task_vector = task_vectors[name] if task_vectors else _task_vector(base_model, config.base, expert, device)
            model = AutoModelForCausalLM.from_pretrained(config.base).eval().to(device)
            model.load_state_dict(merge("task_arithmetic", base_model, [task_vector], lam=config.lam, progress=False))
            scaled.append(model)
    merged = None if config.merged is None else _load_causal_lm(config.merged, config.base, device)
    if merged is None and config.recommend:
        merged = AutoModelForCausalLM.from_pretrained(config.base).eval().to(device)
        merged.load_state_dict(
            merge("task_arithmetic", base_model, list(task_vectors.values()), lam=config.lam, progress=False)
        )

    # LoRA experts: input interference (`input_interference`), on the base model left as it was after.
    adapters = None
    if all(is_adapter_source(expert, "experts") for expert in config.experts):
        interference_base = base_model or AutoModelForCausalLM.from_pretrained(config.base).eval().to(device)
        adapters = (interference_base, dict(zip(composed.expert_names, config.experts)))

    common = dict(settings=config.settings, tokenizer=tokenizer, progress=progress)
    report = measure_overlap(
        composed,
        batches,
        merged_model=merged,
        scaled_expert_models=scaled,
        task_vectors=task_vectors,
        parameter_density=config.parameter_density,
        description="teacher-forced",
        **common,
    )
    results = report.to_dict()
    results["input_interference"] = None if adapters is None else input_interference(*adapters, batches)

    def measured_rollouts(source: str, prompt_batches_: list[dict], description: str) -> tuple[list[dict], dict]:
        """`source`'s greedy rollouts from `prompt_batches_`, and their overlap report."""
        rolled = rollout_batches(
            composed,
            prompt_batches_,
            source=source,
            max_new_tokens=config.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_id,
        )
        rollout_report = measure_overlap(
            composed, rolled, merged_model=merged, scaled_expert_models=scaled, description=description, **common
        )
        return rolled, rollout_report.to_dict()

    results["rollouts"] = {}
    for source in sources:
        rolled, results["rollouts"][source] = measured_rollouts(source, prompts, f"rollouts: {source}")
        if source == "composed" and rule is not None:
            diagnostics, reports = unlabelled_diagnostics(
                composed,
                rolled,
                merged_model=merged,
                task_vectors=task_vectors,
                settings=config.settings,
                progress=progress,
                adapters=adapters,
            )
            # An undefined diagnostic degrades the verdict (`VerdictRule.verdict`) and says why; it never fails the run.
            reasons = undefined_reasons(diagnostics, reports, config.settings)
            results["recommendation"] = recommend(rule, diagnostics, reasons)
    results["expert_data"] = {
        name: measured_rollouts(name, own, f"{name}'s own prompts")[1] for name, own in own_prompts.items()
    }
    # Flat, over the experts: None unless every expert has its own prompts (`own_prompt_statistics`).
    results["own_prompt_statistics"] = own_prompt_statistics(results["expert_data"], composed.expert_names)
    results["experts_loaded"] = dict(zip(composed.expert_names, config.experts))

    resolved = config.model_dump()
    resolved["device"] = device
    with atomic_output_dir(config.out, config.overwrite) as folder:
        write_outputs(folder, results, resolved)
    return results
