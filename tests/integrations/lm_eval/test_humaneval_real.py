"""The HumanEval tasks through lm-eval on the real SmolLM2-135M-Instruct: the model `hf` on both protocols, the model
`composed` with the two real LoRA experts on the instruct one, and `composed` with one expert at weight 0, which is
the base and so answers as `hf` does, stop strings included, on the completion one. Two problems, at most 32 new
tokens (the cap set through `gen_kwargs`)."""

from __future__ import annotations

import json
import os

import lm_eval
import pytest
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed`)
from mergecompose.core.sandbox import sandbox_available
from mergecompose.integrations.lm_eval.humaneval import METRICS, TASK_NAMES, write_humaneval_tasks

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),  # much faster on a loaded machine
    pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available())),
]

MAX_GEN_TOKS = 32
LIMIT = 2
INSTRUCT, COMPLETION = TASK_NAMES
RUNS = [("hf", INSTRUCT), ("hf", COMPLETION), ("composed", INSTRUCT), ("weight_zero", COMPLETION)]


@pytest.fixture(scope="module")
def adapters(one_torch_thread, request):
    """`smollm2_adapters`, trained under one thread if this module is the first to need them."""
    return request.getfixturevalue("smollm2_adapters")


@pytest.fixture(scope="module")
def tasks(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("humaneval_real") / "tasks"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert write_humaneval_tasks(out, tokenizer, allow_code_execution=True) == list(TASK_NAMES)
    records = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()[:LIMIT]]
    manager = TaskManager(include_path=str(out), include_defaults=False)  # lm-eval's own index takes seconds
    return {"manager": manager, "records": records, "tokenizer": tokenizer}


def evaluate(model: str, model_args: dict, tasks, names) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(names),
        limit=LIMIT,
        gen_kwargs={"max_gen_toks": MAX_GEN_TOKS},
        batch_size=LIMIT,
        device="cpu",
        task_manager=tasks["manager"],
        confirm_run_unsafe_code=True,
        log_samples=True,
        verbosity="ERROR",
    )


@pytest.fixture(scope="module")
def runs(smollm2_dir, adapters, tasks):
    """One lm-eval run per model: "hf" on both tasks, "composed" on the instruct one, "weight_zero" on the completion
    one (each composed run costs two or three passes of the base per token)."""
    experts = [str(adapters["math"]), str(adapters["code"])]
    return {
        "hf": evaluate("hf", {"pretrained": str(smollm2_dir), "dtype": "float32"}, tasks, TASK_NAMES),
        "composed": evaluate("composed", {"base": str(smollm2_dir), "experts": experts}, tasks, [INSTRUCT]),
        "weight_zero": evaluate(
            "composed", {"base": str(smollm2_dir), "experts": experts[:1], "weights": [0.0]}, tasks, [COMPLETION]
        ),
    }


def responses(results: dict, task: str) -> list[str]:
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["resps"][0][0] for sample in samples]


@pytest.mark.parametrize("model, task", RUNS)
def test_metrics_and_per_sample_logs(runs, tasks, model, task):
    results, tokenizer = runs[model], tasks["tokenizer"]
    scores = results["results"][task]
    strict, lenient = (scores[f"{metric},none"] for metric in METRICS)
    assert 0.0 <= strict <= lenient <= 1.0, scores
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    assert [sample["doc"]["task_id"] for sample in samples] == [record["task_id"] for record in tasks["records"]]
    lengths = []
    for sample, record in zip(samples, tasks["records"], strict=True):
        context, generation = sample["arguments"][0]
        assert generation["max_gen_toks"] == MAX_GEN_TOKS and generation["do_sample"] is False
        assert all(sample[metric] in (0.0, 1.0) for metric in METRICS), sample
        answer = sample["resps"][0][0]
        assert isinstance(answer, str)
        lengths.append(len(tokenizer.encode(answer, add_special_tokens=False)))
        if task == INSTRUCT:  # the rendered chat prompt, as written into the task's data
            assert context == record["instruct_prompt"]
            assert context.startswith("<|im_start|>system\n") and context.endswith("<|im_start|>assistant\n")
            assert record["prompt"].rstrip() in context
        else:
            assert context == record["prompt"]
    assert max(lengths) <= MAX_GEN_TOKS  # the cap of gen_kwargs, not the task's 384 or 512
    if task == INSTRUCT:  # a chat answer: code cut by the cap, not an empty reply
        assert min(lengths) > MAX_GEN_TOKS // 2


def test_an_expert_at_weight_zero_answers_as_the_base(runs):
    # log p_b + 0 · (log p_math − log p_b) = log p_b: the same greedy answers, cut at the same stop strings, as
    # lm-eval's own `hf` model.
    assert responses(runs["weight_zero"], COMPLETION) == responses(runs["hf"], COMPLETION)


def test_the_experts_change_some_answer(runs):
    # Not vacuous: the two trained experts at weight 1 each move the greedy answer of at least one problem.
    assert responses(runs["composed"], INSTRUCT) != responses(runs["hf"], INSTRUCT)
