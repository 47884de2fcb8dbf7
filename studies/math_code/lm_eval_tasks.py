"""The study's held-out splits as local lm-eval tasks, scored by this package's strict and lenient scores.

`write_study_tasks(out, tokenizer, sizes, ...)` writes into the folder `out` (lm-eval's `include_path`):

    mc_math        math test split: the final answer (`score_math`)
    mc_code        code test split: pass@1 of the function, its tests run in the sandbox (`score_code`)
    mc_mixed       mixed test split: both parts right (`score_mixed`)
    mc_validation  the first `validation // 2` math and the rest code problems of the validation splits,
                   each scored by its kind: where merge grids are chosen (never a test item)

and, with `humaneval`, `humaneval_sandbox_instruct` and `humaneval_sandbox_completion`
(`mergecompose.integrations.lm_eval.humaneval`). Each record holds the prompt rendered by the chat
template with the study's `SYSTEM_PROMPT` (`generation_text`, the text the experts were trained to
continue), so lm-eval's `hf` and `composed` models see the same tokens; generation is greedy and stops
at `<|im_end|>` or at the split's `max_gen_toks`. Every task reports `strict` and `lenient` (0/1 per
sample, mean over samples); the code tasks set `unsafe_code: true`, so they run only with
`allow_code_execution`, and their programs run in `mergecompose.core.sandbox`, never in lm-eval's process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mergecompose.core.io import atomic_write_text
from mergecompose.core.sandbox import sandbox_available
from mergecompose.integrations.lm_eval.humaneval import (
    COMPLETION_MAX_GEN_TOKS,
    INSTRUCT_MAX_GEN_TOKS,
    write_hooked_task,
    write_humaneval_tasks,
)
from mergecompose.studies.math_code.chat_data import END_OF_TURN, generation_text
from mergecompose.studies.math_code.code_problems import CodeProblem, code_split
from mergecompose.studies.math_code.math_problems import MathProblem, math_split
from mergecompose.studies.math_code.mixed import MixedProblem, mixed_split
from mergecompose.studies.math_code.scoring import score_code, score_math, score_mixed

METRICS = ("strict", "lenient")
HOOKS_MODULE = "math_code_hooks"  # the file beside the YAMLs that lm-eval's `!function` loads
TASKS = ("mc_math", "mc_code", "mc_mixed", "mc_validation")


def _math_record(problem: MathProblem) -> dict:
    return {"kind": "math", "prompt": problem.prompt, "problem": asdict(problem), "target": problem.solution}


def _code_record(problem: CodeProblem) -> dict:
    return {"kind": "code", "prompt": problem.prompt, "problem": asdict(problem), "target": problem.answer}


def _mixed_record(problem: MixedProblem) -> dict:
    return {
        "kind": "mixed",
        "prompt": problem.prompt,
        "problem": {"math": asdict(problem.math), "code": asdict(problem.code)},
        "target": problem.answer,
    }


def score_record(doc: Mapping[str, Any], output: str) -> dict[str, float]:
    """`{"strict": 0|1, "lenient": 0|1}` of `output` for the problem a task record holds (by its `kind`)."""
    kind, problem = doc["kind"], doc["problem"]
    if kind == "math":
        score = score_math(output, int(problem["answer"]))
    elif kind == "code":
        score = score_code([output], [CodeProblem(**problem)], workers=1)[0]
    elif kind == "mixed":
        mixed = MixedProblem(MathProblem(**problem["math"]), CodeProblem(**problem["code"]))
        return {name: float(getattr(score_mixed([output], [mixed], workers=1)[0], name)) for name in METRICS}
    else:
        raise ValueError(f"a study task record's `kind` must be math, code or mixed, got {kind!r}")
    return {"strict": float(score.strict), "lenient": float(score.lenient)}


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval's `process_results` of every study task: one greedy output per record."""
    if len(results) != 1 or not isinstance(results[0], str):
        raise ValueError(f"`results` must be one generated text (repeats: 1), got {results!r:.80}")
    return score_record(doc, results[0])


def study_records(sizes: Mapping[str, int], seed: int = 0) -> dict[str, list[dict]]:
    """Each task's records: `sizes["math"]`, `["code"]`, `["mixed"]` test problems and `["validation"]`
    validation problems (half math, half code); a size of 0 gives no records."""
    validation = int(sizes["validation"])
    return {
        "mc_math": [_math_record(problem) for problem in math_split("test", sizes["math"], seed)],
        "mc_code": [_code_record(problem) for problem in code_split("test", sizes["code"], seed)],
        "mc_mixed": [_mixed_record(problem) for problem in mixed_split("test", sizes["mixed"], seed)]
        if sizes["mixed"]
        else [],
        "mc_validation": [
            *(_math_record(problem) for problem in math_split("validation", validation // 2, seed)),
            *(_code_record(problem) for problem in code_split("validation", validation - validation // 2, seed)),
        ],
    }


def write_study_tasks(
    out: str | Path,
    tokenizer: Any,
    sizes: Mapping[str, int],
    max_gen_toks: Mapping[str, int],
    *,
    humaneval: bool = True,
    allow_code_execution: bool,
    seed: int = 0,
) -> list[str]:
    """Write the study's tasks into the folder `out` (see the module docstring); their names.

    `sizes` and `max_gen_toks` have the keys math, code, mixed and validation (the validation task's cap is
    the larger of math's and code's when not given); `max_gen_toks` may also cap `humaneval_instruct` and
    `humaneval_completion` (by default `humaneval.INSTRUCT_MAX_GEN_TOKS` and `COMPLETION_MAX_GEN_TOKS`).
    Refused before anything is written without `allow_code_execution=True` or where the sandbox does not run.
    """
    if allow_code_execution is not True:
        raise ValueError(
            "`allow_code_execution` must be true to write the study's tasks: the code splits run model-written "
            f"code (in mergecompose.core.sandbox), got {allow_code_execution!r}"
        )
    reason = sandbox_available()
    if reason is not None:
        raise OSError(f"the study's code tasks need the code sandbox: {reason}")
    missing = [key for key in ("math", "code", "mixed", "validation") if key not in sizes]
    if missing:
        raise ValueError(f"`sizes` must give math, code, mixed and validation, got {dict(sizes)}")
    caps = {"validation": max(max_gen_toks["math"], max_gen_toks["code"]), **max_gen_toks}
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        folder / f"{HOOKS_MODULE}.py",
        '"""lm-eval\'s hook of the study\'s tasks, written by '
        'mergecompose.studies.math_code.lm_eval_tasks.write_study_tasks."""\n\n'
        "from mergecompose.studies.math_code.lm_eval_tasks import process_results\n\n"
        '__all__ = ["process_results"]\n',
    )
    names = []
    for name, records in study_records(sizes, seed).items():
        if not records:  # a split of size 0 is left out
            continue
        rendered = [{**record, "text": generation_text(tokenizer, record["prompt"])} for record in records]
        data = (folder / f"{name}.jsonl").resolve()
        atomic_write_text(data, "".join(json.dumps(record) + "\n" for record in rendered))
        split = name.removeprefix("mc_")
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "unsafe_code": split != "math",
            "output_type": "generate_until",
            "doc_to_text": "text",
            "doc_to_target": "target",
            "target_delimiter": "",
            "num_fewshot": 0,
            "repeats": 1,
            "generation_kwargs": {"until": [END_OF_TURN], "max_gen_toks": int(caps[split]), "do_sample": False},
            "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in METRICS],
            "metadata": {"version": 1.0},
        }
        write_hooked_task(folder / f"{name}.yaml", task, f"{HOOKS_MODULE}.process_results")
        names.append(name)
    if humaneval:
        names += write_humaneval_tasks(
            folder,
            tokenizer,
            allow_code_execution=True,
            instruct_max_gen_toks=int(max_gen_toks.get("humaneval_instruct", INSTRUCT_MAX_GEN_TOKS)),
            completion_max_gen_toks=int(max_gen_toks.get("humaneval_completion", COMPLETION_MAX_GEN_TOKS)),
        )
    return names
