"""`mergecompose decide`: merge or compose *these* experts, measured on a labelled joint task at the lowest cost.

1. **Choices, on the validation items** (`--validation-task`, or the first `validation` items of the task in a
   seeded random order): every merge of the grid (task arithmetic and TIES, ≤ 3 points each, through
   `mergecompose.merging.merge`) and every composition (`compose@w` at ≤ 3 weights, each remedy at weights 1)
   answers them; the best of each kind is the first of the highest accuracies, in grid order, as `real-sweep`.
2. **The test, item by item** (the other items, in that random order): the chosen merge and composition answer
   the same item, and the sequential rule (`mergecompose.analysis.sequential_decision`) stops as soon as its
   anytime-valid bounds decide "merge", "compose", "either" or "neither" at the error rate α, or at the budget
   (`max_items`) with the fixed-n label, marked "budget reached".

Greedy answers of at most `max_new_tokens` tokens, through the base's chat format where it has one
(`math_code.chat_data`: ChatML or Gemma's turns), else the prompt as it is. The run folder keeps every
validation cell (`cells/`) and every test item answered (`test_items.jsonl`, one line per item, appended as
it is scored), so an interrupted run resumes where it stopped; `results.json` and `results.md` are written once,
atomically, at the end.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel
from pydantic import Field, field_validator, model_validator
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from mergecompose.analysis.sequential_decision import DecisionSettings, SequentialDecision
from mergecompose.composition import ComposedLM
from mergecompose.composition.loading import PretrainedSources, check_pretrained_sources
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.io import StrictModel, atomic_write_text, markdown_table
from mergecompose.experiments.compare_config import MergeGrid, check_merge_grids, fingerprint
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.merging import TaskVector, merge
from mergecompose.studies.decide.joint_task import TaskItem, load_scorer, read_task
from mergecompose.studies.math_code.chat_data import chat_format, end_of_turn_id, generation_inputs

DECIDE_FOLDER = FolderLayout("a decide folder", cached=("cells", "test_items.jsonl"), leftovers=("cells",))
TEST_LOG = "test_items.jsonl"


class DecideConfig(StrictModel):
    """What `decide` runs (the command line's flags; see the module docstring)."""

    base: str
    experts: list[str] = Field(min_length=2)
    names: list[str] | None = None
    task: str
    validation_task: str | None = None
    scorer: str = "skills"
    validation: int = Field(40, ge=1)
    max_items: int | None = Field(None, ge=1)
    alpha: float = Field(0.05, gt=0, lt=0.5)
    delta: float = Field(0.10, gt=0, lt=1)
    seed: int = Field(0, ge=0)
    max_new_tokens: int = Field(48, ge=1, le=4096)
    batch_size: int = Field(8, ge=1, le=1024)
    merges: dict[str, MergeGrid] = Field(
        default_factory=lambda: {
            "task_arithmetic": MergeGrid(lam=[0.5, 1.0, 1.5]),
            "ties": MergeGrid(lam=[1.0, 1.5], density=[0.5]),
        },
        min_length=1,
    )
    weights: list[float] = Field(default_factory=lambda: [1.0, 0.75], min_length=1, max_length=3)
    remedies: dict[str, RemedySettings] = Field(
        default_factory=lambda: {"gate": RemedySettings(gate=0.1), "shared_delta": RemedySettings(shared_delta=True)}
    )

    @field_validator("merges")
    @classmethod
    def _grids(cls, merges: dict[str, MergeGrid]) -> dict[str, MergeGrid]:
        check_merge_grids(merges)
        for method, grid in merges.items():
            if len(grid.candidates()) > 3:
                raise ValueError(f"`merges.{method}` must have at most 3 grid points, got {len(grid.candidates())}")
        return merges

    @model_validator(mode="after")
    def _names(self) -> DecideConfig:
        if self.names is not None and len(self.names) != len(self.experts):
            raise ValueError(f"`names` must name each of the {len(self.experts)} experts, got {len(self.names)}")
        return self

    @property
    def settings(self) -> DecisionSettings:
        return DecisionSettings(alpha=self.alpha, delta=self.delta, max_items=self.max_items)


class PreparedDecide:
    """What the pre-flight checked, before any weight loads: the config, the items, the scorer and the sources."""

    def __init__(self, config: DecideConfig):
        self.config = config
        self.score, check_reference = load_scorer(config.scorer)
        items = read_task(config.task, "--task", check_reference)
        if config.validation_task is not None:
            self.validation = read_task(config.validation_task, "--validation-task", check_reference)
            self.validation = self.validation[: config.validation]
            self.test = _shuffled(items, config.seed)
        else:
            if len(items) <= config.validation:
                raise ValueError(
                    f"`--task` {config.task!r} holds {len(items)} items: at least {config.validation + 1} are needed "
                    f"for {config.validation} validation items (--validation) and one test item, or give "
                    "--validation-task"
                )
            order = _shuffled(items, config.seed)
            self.validation, self.test = order[: config.validation], order[config.validation :]
        self.sources: PretrainedSources = check_pretrained_sources(
            config.base, config.experts, None, config.names, "stacked", {"dtype": torch.float32}
        )
        if self.sources.tokenizer is None:
            raise ValueError(f"`--base` {config.base!r} has no tokenizer: decide needs one to read the prompts")


def _shuffled(items: Sequence[TaskItem], seed: int) -> list[TaskItem]:
    order = list(items)
    random.Random(seed).shuffle(order)
    return order


def stop_id(tokenizer) -> int | None:
    """The chat format's end-of-turn token where the tokenizer has a chat format, else its EOS token."""
    try:
        return end_of_turn_id(tokenizer)
    except ValueError:
        return tokenizer.eos_token_id


def answers(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of a causal LM or a `ComposedLM` to `prompts`, as one batch, decoded."""
    stop = stop_id(tokenizer)
    try:
        chat_format(tokenizer)
        inputs = generation_inputs(tokenizer, prompts)  # (B, T) each
    except ValueError:
        previous, tokenizer.padding_side = tokenizer.padding_side, "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        inputs = dict(tokenizer(prompts, return_tensors="pt", padding=True))
        tokenizer.padding_side = previous
    with torch.no_grad():
        if isinstance(model, ComposedLM):
            out = model.generate(
                inputs["input_ids"], inputs["attention_mask"], max_new_tokens=max_new_tokens, eos_token_id=stop,
                pad_token_id=stop,
            )  # fmt: skip
        else:
            out = model.generate(
                **inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop
            )
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)  # (B, n) new


class Systems:
    """The base, once in memory, and the merges and compositions built from it on demand."""

    def __init__(self, prepared: PreparedDecide):
        sources = prepared.sources
        self.tokenizer = sources.tokenizer
        self.names = sources.names
        self.base = AutoModelForCausalLM.from_pretrained(sources.base, dtype=torch.float32).eval()
        self.adapters = dict(zip(self.names, prepared.config.experts)) if all(sources.is_adapter) else None
        self._experts: list | None = None
        self._task_vectors: list[TaskVector] | None = None
        self.sources = prepared.config.experts
        self.is_adapter = sources.is_adapter

    def experts(self) -> list:
        """Each expert as a full model (an adapter merged into a copy of the base), loaded once."""
        if self._experts is None:
            self._experts = [
                PeftModel.from_pretrained(copy.deepcopy(self.base), source).merge_and_unload().eval()
                if adapter
                else AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
                for source, adapter in zip(self.sources, self.is_adapter)
            ]
        return self._experts

    def task_vectors(self) -> list[TaskVector]:
        """Each expert's task vector: an adapter's dense ΔW (`TaskVector.from_lora`), a checkpoint's θ_i − θ_b."""
        if self._task_vectors is None:
            vectors = []
            for index, (source, adapter) in enumerate(zip(self.sources, self.is_adapter)):
                if adapter:
                    vectors.append(TaskVector.from_lora(self.base, source))
                else:
                    vectors.append(TaskVector.from_models(self.base, self.experts()[index]))
            self._task_vectors = vectors
        return self._task_vectors

    def merged(self, method: str, params: dict):
        model = copy.deepcopy(self.base)
        model.load_state_dict(merge(method, self.base, self.task_vectors(), progress=False, **params))
        return model.eval()

    def composed(self, weights: Sequence[float], remedy: RemedySettings | None = None) -> ComposedLM:
        remedies = remedy.build(stop_id(self.tokenizer)) if remedy is not None else ()
        if self.adapters is not None:  # LoRA experts on the base itself; `close()` gives it back
            return ComposedLM.from_adapters(
                self.base, self.adapters, list(weights), tokenizer=self.tokenizer, remedies=remedies
            )
        return ComposedLM(self.base, self.experts(), list(weights), self.tokenizer, remedies, names=self.names)

    def candidates(self, config: DecideConfig) -> tuple[dict[str, Callable], dict[str, Callable]]:
        """The merges and compositions to choose from, by name, in grid order, each with its builder."""
        k = len(self.names)
        merges = {
            f"merge:{method}@{point_name(params)}": (lambda m=method, p=params: self.merged(m, p))
            for method, grid in config.merges.items()
            for params in grid.candidates()
        }
        compositions: dict[str, Callable] = {
            f"compose@{weight:g}": (lambda w=weight: self.composed([w] * k)) for weight in config.weights
        }
        for name, remedy in config.remedies.items():
            compositions[f"compose+{name}"] = lambda r=remedy: self.composed([1.0] * k, r)
        return merges, compositions


def point_name(params: dict) -> str:
    return ",".join(
        f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}" for key, value in params.items()
    )


def _close(model) -> None:
    if isinstance(model, ComposedLM):
        model.close()


def validation_cell(run: RunFolder, systems: Systems, prepared: PreparedDecide, name: str, build: Callable) -> dict:
    """One candidate's right/wrong on the validation items (cached in `cells/`)."""
    config, items = prepared.config, prepared.validation
    path = run.file("cells") / f"{name.replace(':', '_')}--validation.json"
    prompts = [item.prompt for item in items]
    if path.is_file():
        cached = json.loads(path.read_text(encoding="utf-8"))
        if cached.get("prompts") == prompts:
            return cached
    started = time.perf_counter()
    model = build()
    try:
        outputs = []
        for start in range(0, len(prompts), config.batch_size):
            outputs += answers(
                model, systems.tokenizer, prompts[start : start + config.batch_size], config.max_new_tokens
            )
    finally:
        _close(model)
    right = [scored(prepared, item, output) for item, output in zip(items, outputs)]
    cell = {"system": name, "prompts": prompts, "outputs": outputs, "right": right, "accuracy": sum(right) / len(right)}
    cell["seconds"] = round(time.perf_counter() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(cell) + "\n")
    return cell


def read_test_log(path: Path, test: Sequence[TaskItem], chosen: dict[str, str]) -> list[dict]:
    """The test items already scored by these two systems, in order; a line cut by a crash ends the log."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break  # the last line, half-written when the run was killed
        index = len(rows)
        if index >= len(test) or row.get("prompt") != test[index].prompt or row.get("systems") != chosen:
            break
        rows.append(row)
    return rows


def run_decide(
    prepared: PreparedDecide, out_dir: str | os.PathLike, overwrite: bool = False, progress: bool = True
) -> dict:
    """Choose on validation, then score the test items until the sequential rule decides; returns results.json."""
    config = prepared.config
    run = RunFolder(out_dir, DECIDE_FOLDER)
    # The budget and the batch size change no answer: a rerun with a larger budget goes on from the log.
    config_hash = fingerprint(config.model_dump(mode="json", exclude={"max_items", "batch_size"}))
    settings = config.settings
    with run.claim(config_hash, overwrite):
        with run.stage("load"):
            systems = Systems(prepared)
        merges, compositions = systems.candidates(config)
        chosen, validation = {}, {}
        with run.stage("validation"):
            bar = tqdm(total=len(merges) + len(compositions), desc="validation", disable=not progress)
            for kind, candidates in (("merge", merges), ("compose", compositions)):
                scores = {}
                for name, build in candidates.items():
                    scores[name] = validation_cell(run, systems, prepared, name, build)["accuracy"]
                    bar.update()
                chosen[kind] = max(scores, key=lambda name: scores[name])  # the first of the highest, in grid order
                validation[kind] = scores
            bar.close()
        with run.stage("test"):
            decision = _test_loop(run, systems, prepared, chosen, {**merges, **compositions}, settings, progress)
        results = {
            "config_hash": config_hash,
            "label": decision["label"],
            "budget_reached": decision["budget_reached"],
            "test_items_used": decision["items"],
            "test_items_available": len(prepared.test),
            "max_items": settings.max_items,
            "chosen": chosen,
            "validation": {"items": len(prepared.validation), **validation},
            "decision": decision,
            "settings": {"alpha": settings.alpha, "delta": settings.delta, "floor": settings.floor},
            "scorer": config.scorer,
            "timings": {**run.timings, "total": run.elapsed()},
        }
        run.write_json("results.json", results)
        run.write_text("results.md", results_markdown(results))
        run.write_config(config)
    return results


def _test_loop(run, systems, prepared, chosen, builders, settings, progress) -> dict:
    """Feed the rule the logged items, then answer and log new ones, a batch at a time, until it decides or the
    budget is spent (`rows` holds every item answered, in the test order; the rule has read `fed` of them)."""
    config, test = prepared.config, prepared.test
    budget = min(len(test), settings.max_items or len(test))
    log = run.file(TEST_LOG)
    rows = read_test_log(log, test, chosen)
    atomic_write_text(log, "".join(json.dumps(row) + "\n" for row in rows))  # drop a cut line, keep the rest
    rule = SequentialDecision(settings)
    bar = tqdm(total=budget, desc="test items", disable=not progress)
    fed = 0

    def feed_logged() -> int:
        nonlocal fed
        while fed < min(len(rows), budget) and not rule.done[0]:
            rule.update(np.array([rows[fed]["merge"]["right"]]), np.array([rows[fed]["compose"]["right"]]))
            fed += 1
            merge_right, compose_right, merge_only, compose_only = (int(v) for v in rule.counts[0])
            bar.set_postfix_str(f"merge {merge_right}, compose {compose_right}, discordant {merge_only}/{compose_only}")
            bar.update()
        return fed

    models: dict[str, object] = {}
    try:
        with open(log, "a", encoding="utf-8") as handle:
            while feed_logged() < budget and not rule.done[0]:
                chunk = test[len(rows) : min(len(rows) + config.batch_size, budget)]
                prompts = [item.prompt for item in chunk]
                outputs = {}
                for kind in ("merge", "compose"):
                    if kind not in models:
                        models[kind] = builders[chosen[kind]]()
                    outputs[kind] = answers(models[kind], systems.tokenizer, prompts, config.max_new_tokens)
                for index, item in enumerate(chunk):
                    row = {"prompt": item.prompt, "systems": chosen}
                    for kind in ("merge", "compose"):
                        output = outputs[kind][index]
                        row[kind] = {"output": output, "right": scored(prepared, item, output)}
                    handle.write(json.dumps(row) + "\n")
                    handle.flush()
                    os.fsync(handle.fileno())  # an item answered is an item kept
                    rows.append(row)
    finally:
        for model in models.values():
            _close(model)
        bar.close()
    rule.finish([[row["merge"]["right"] for row in rows[:fed]]], [[row["compose"]["right"] for row in rows[:fed]]])
    return rule.decision(0).to_dict()


def scored(prepared: PreparedDecide, item: TaskItem, output: str) -> bool:
    """The scorer's verdict on one answer; a scorer that fails or answers other than True/False is named."""
    try:
        right = prepared.score(item.prompt, output, item.reference)
    except Exception as error:  # noqa: BLE001 - the user's scorer: any failure is theirs to see, in one line
        raise ValueError(
            f"`--scorer` {prepared.config.scorer!r} raised {type(error).__name__}: {error} (prompt {item.prompt!r:.60})"
        ) from None
    if not isinstance(right, (bool, np.bool_)):
        raise ValueError(
            f"`--scorer` {prepared.config.scorer!r} must return True or False, got {right!r:.40} "
            f"({type(right).__name__})"
        )
    return bool(right)


LABEL_TEXT = {
    "merge": "merge: the merge is significantly better, and works",
    "compose": "compose: the composition is significantly better, and works",
    "either": "either: both work, and their accuracies are within ±δ",
    "neither": "neither: neither reaches the floor",
}


def results_markdown(results: dict) -> str:
    decision = results["decision"]
    n = decision["items"]
    rows = [
        [
            "merge",
            results["chosen"]["merge"],
            f"{decision['merge_right']} / {n}",
            _interval(decision["merge_interval"]),
        ],
        [
            "composition",
            results["chosen"]["compose"],
            f"{decision['compose_right']} / {n}",
            _interval(decision["compose_interval"]),
        ],
    ]
    label = LABEL_TEXT[results["label"]] + (
        " (budget reached: the fixed-n test's label)" if results["budget_reached"] else ""
    )
    settings = results["settings"]
    lines = [
        f"# Merge or compose: {results['label']}",
        "",
        f"**{label}** after {n} of {results['test_items_available']} test items (α = {settings['alpha']}, "
        f"δ = {settings['delta']}, floor {settings['floor']}).",
        "",
        markdown_table(["system", "chosen on validation", "right", "accuracy, anytime 95 % bounds"], rows),
        "",
        f"Discordant items: merge only {decision['merge_only']}, composition only {decision['compose_only']}; the "
        f"difference compose − merge lies in {_interval(decision['difference_interval'])}.",
        "",
        f"Validation ({results['validation']['items']} items): "
        + ", ".join(
            f"{name} {100 * value:.1f} %"
            for kind in ("merge", "compose")
            for name, value in results["validation"][kind].items()
        ),
    ]
    return "\n".join(lines) + "\n"


def _interval(bounds: Sequence[float]) -> str:
    return f"[{100 * bounds[0]:.1f} %, {100 * bounds[1]:.1f} %]"
