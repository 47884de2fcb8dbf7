"""The lm-eval model `composed` on tiny local tasks: identities against lm-eval's `hf` and our own code, bad input."""

from __future__ import annotations

import json
import math
import os

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed`)
from mergecompose.analysis.data import char_tokenizer
from mergecompose.cli import main
from mergecompose.composition import ComposedLM, compose_logprobs

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456 "  # 60 + 4 specials = vocab 64
SOURCES = ["ABC", "XYZ AB", "HELLO", "QRS T", "MNOP", "AAB"]


def _task_yaml(name: str, data: str, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        f"{body}metadata:\n  version: 1.0\n"
    )


@pytest.fixture(scope="module")
def setup(base_model, lora_dirs, tmp_path_factory):
    """Saved checkpoints (base, a copy of it, a base with another tokenizer) and three tiny local tasks."""
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = char_tokenizer(CHARACTERS)
    for name in ("base", "same"):
        base_model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    base_model.save_pretrained(root / "other_tokenizer")
    char_tokenizer(CHARACTERS[::-1]).save_pretrained(root / "other_tokenizer")
    rows = [
        {"source": s, "target": s.lower(), "choices": [s.lower(), s, s[::-1]], "label": 0, "text": s + " " + s.lower()}
        for s in SOURCES
    ]
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        _task_yaml(
            "tiny_mc",
            data,
            (
                'output_type: multiple_choice\ndoc_to_text: "{{source}}="\ndoc_to_target: label\n'
                "doc_to_choice: choices\n"
                "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            ),
        )
    )
    (tasks / "tiny_gen.yaml").write_text(
        _task_yaml(
            "tiny_gen",
            data,
            (
                'output_type: generate_until\ndoc_to_text: "{{source}}="\ndoc_to_target: target\n'
                'generation_kwargs:\n  until: ["Q", "7"]\n  max_gen_toks: 10\n  do_sample: false\n'
                "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
            ),
        )
    )
    (tasks / "tiny_rolling.yaml").write_text(
        _task_yaml(
            "tiny_rolling",
            data,
            (
                'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
            ),
        )
    )
    (tasks / "tiny_unsafe.yaml").write_text(
        _task_yaml(
            "tiny_unsafe",
            data,
            (
                'output_type: generate_until\ndoc_to_text: "{{source}}="\ndoc_to_target: target\nunsafe_code: true\n'
                'generation_kwargs:\n  until: ["Q"]\n  max_gen_toks: 4\n'
                "metric_list:\n  - metric: exact_match\n"
            ),
        )
    )
    task_manager = TaskManager(include_path=str(tasks))  # indexes lm-eval's own tasks too: build it once
    return {"root": root, "tokenizer": tokenizer, "tasks": tasks, "adapters": lora_dirs, "task_manager": task_manager}


def _samples(model: str, model_args: dict, task: str, setup) -> list[dict]:
    output = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=setup["task_manager"],
        log_samples=True,
        batch_size=2,
        verbosity="ERROR",
    )
    return sorted(output["samples"][task], key=lambda sample: sample["doc_id"])


def _hf(setup) -> dict:
    return {"pretrained": str(setup["root"] / "base"), "device": "cpu", "dtype": "float32"}


def _identity(setup) -> dict:
    """The composition of one expert equal to the base: log p_b + (log p_b − log p_b) = log p_b."""
    return {"base": str(setup["root"] / "base"), "experts": [str(setup["root"] / "same")]}


def _error_lines(capsys) -> list[str]:
    """Our error lines on stderr (transformers' progress bars may stand before them)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("mergecompose")]


def _floats(samples: list[dict]) -> list[float]:
    return [value for sample in samples for response in sample["resps"] for value in _numbers(response)]


def _numbers(response) -> list[float]:
    if isinstance(response, (list, tuple)):
        return [value for item in response for value in _numbers(item)]
    return [float(response)] if isinstance(response, float) else []


@pytest.mark.parametrize("task", ["tiny_mc", "tiny_rolling"])
def test_one_expert_equal_to_the_base_scores_like_hf(setup, task):
    ours, theirs = _samples("composed", _identity(setup), task, setup), _samples("hf", _hf(setup), task, setup)
    assert len(ours) == len(theirs) == len(SOURCES)
    difference = max(abs(a - b) for a, b in zip(_floats(ours), _floats(theirs), strict=True))
    assert difference < 1e-4
    assert all(a < 0 for a in _floats(ours))  # real log-likelihoods, not a degenerate constant


def test_one_expert_equal_to_the_base_generates_like_hf(setup):
    ours, theirs = (
        _samples("composed", _identity(setup), "tiny_gen", setup),
        _samples("hf", _hf(setup), "tiny_gen", setup),
    )
    assert [s["resps"] for s in ours] == [s["resps"] for s in theirs]
    assert any(len(s["resps"][0][0]) > 0 for s in ours)  # something was generated


def test_loglikelihood_is_the_sum_of_composed_logprobs_over_the_continuation(setup):
    adapters = setup["adapters"]
    args = {
        "base": str(setup["root"] / "base"),
        "experts": [str(adapters["ab"]), str(adapters["cd"])],
        "weights": "1.0|0.5",
    }
    samples = _samples("composed", args, "tiny_mc", setup)
    tokenizer = setup["tokenizer"]
    lm = ComposedLM.from_pretrained(str(setup["root"] / "base"), experts=[str(adapters["ab"]), str(adapters["cd"])])
    for sample in samples:
        context = sample["doc"]["source"] + "="
        for choice, response in zip(sample["doc"]["choices"], sample["resps"], strict=True):
            context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
            continuation_ids = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([context_ids + continuation_ids])
            components = lm.component_logprobs(ids[:, :-1])  # (k+1, 1, T-1, V), base first
            composed = compose_logprobs(components[0], list(components[1:]), weights=[1.0, 0.5])  # (1, T-1, V)
            targets = ids[0, len(context_ids) :]
            expected = composed[0, len(context_ids) - 1 :].gather(-1, targets[:, None]).sum().item()
            assert math.isclose(response[0][0], expected, abs_tol=1e-4), (choice, response[0][0], expected)


def test_generate_until_equals_composed_generate_cut_at_the_stop(setup):
    adapters = setup["adapters"]
    experts = [str(adapters["ab"]), str(adapters["cd"])]
    samples = _samples("composed", {"base": str(setup["root"] / "base"), "experts": experts}, "tiny_gen", setup)
    tokenizer = setup["tokenizer"]
    lm = ComposedLM.from_pretrained(str(setup["root"] / "base"), experts=experts)
    for sample in samples:
        prompt = torch.tensor([tokenizer(sample["doc"]["source"] + "=", add_special_tokens=False)["input_ids"]])
        out = lm.generate(
            prompt, max_new_tokens=10, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        text = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
        for stop in ("Q", "7"):
            text = text.split(stop)[0]
        assert sample["resps"][0][0] == text


def test_model_args_as_a_string_with_bars(setup):
    adapters = setup["adapters"]
    string = (
        f"base={setup['root'] / 'base'},experts={adapters['ab']}|{adapters['cd']},weights=1.0|1.0,remedies=gate:0.1"
    )
    model = lm_eval.api.registry.get_model("composed").create_from_arg_string(
        string, {"batch_size": 2, "device": "cpu"}
    )
    assert model.composed.expert_names == ["ab", "cd"] and len(model.composed.remedies) == 1


def test_model_args_name_a_remedy_of_ones_own(setup):
    """`remedies=gate:0.1;class:user_remedies:Scale;alpha:0.5`: the built-in gate, then the user's remedy (a module
    outside the package) with its parameter read as YAML."""
    adapters = setup["adapters"]
    string = (
        f"base={setup['root'] / 'base'},experts={adapters['ab']}|{adapters['cd']},"
        "remedies=gate:0.1;class:user_remedies:Scale;alpha:0.5"
    )
    model = lm_eval.api.registry.get_model("composed").create_from_arg_string(string, {"device": "cpu"})
    gate, scale = model.composed.remedies
    assert type(gate).__name__ == "ActivityGate" and type(scale).__name__ == "Scale" and scale.alpha == 0.5


def test_experts_with_another_tokenizer_are_refused_naming_both(setup):
    with pytest.raises(ValueError, match="tokenizer") as error:
        _samples(
            "composed",
            {"base": str(setup["root"] / "base"), "experts": [str(setup["root"] / "other_tokenizer")]},
            "tiny_mc",
            setup,
        )
    assert "other_tokenizer" in str(error.value) or "expert" in str(error.value)


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ("experts=", "`experts` must list one or more entries"),
        ("weights=1.0|x", "`weights` must be numbers"),
        ("remedies=gate", "`remedies` must be `field:value` pairs"),
        ("remedies=gate:-1", "gate: Input should be greater than or equal to 0"),
        ("remedies=class:user_remedies:NoMethod", "NoMethod declares phase 'mask' but has no method `allowed`"),
        ("dtype=float8", "`dtype` must be one of"),
        ("chunk_megabytes=0", r"`chunk_megabytes` must be a positive integer \(it must be >= 1\), got 0"),
    ],
)
def test_bad_model_args_are_clear_errors_before_any_model_loads(setup, model_args, message):
    string = f"base={setup['root'] / 'no_such_base'},experts={setup['root'] / 'same'},{model_args}"
    with pytest.raises(ValueError, match=message):  # the base does not exist: the check came first
        lm_eval.api.registry.get_model("composed").create_from_arg_string(string, {"device": "cpu"})


def test_bad_input_through_the_cli_is_one_line(setup, capsys):
    arguments = [
        "lm-eval",
        "--model",
        "composed",
        "--model_args",
        f"base={setup['root'] / 'base'},experts={setup['root'] / 'same'}",
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(setup["tasks"]),
    ]
    assert main([*arguments, "--device", "cpu", "--batch_size", "auto"]) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and "`batch_size` must be a positive integer" in error[0], error
    if not torch.cuda.is_available():  # lm-eval's default device is cuda
        assert main(arguments) == 2
        error = _error_lines(capsys)
        assert len(error) == 1 and "no CUDA device is available" in error[0], error


def test_a_missing_adapter_is_one_clear_line(setup, capsys):
    arguments = [
        "lm-eval",
        "--model",
        "composed",
        "--model_args",
        f"base={setup['root'] / 'base'},experts={setup['root'] / 'no_such_adapter'}",
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(setup["tasks"]),
        "--device",
        "cpu",
    ]
    assert main(arguments) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and error[0].startswith("mergecompose lm-eval: error:") and "no_such_adapter" in error[0], (
        error
    )


def test_an_unknown_task_is_refused(setup, capsys):
    arguments = [
        "lm-eval",
        "--model",
        "composed",
        "--model_args",
        f"base={setup['root'] / 'base'},experts={setup['root'] / 'same'}",
        "--tasks",
        "no_such_task",
        "--include_path",
        str(setup["tasks"]),
        "--device",
        "cpu",
    ]
    assert main(arguments) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and error[0].startswith("mergecompose lm-eval: error:") and "no_such_task" in error[0], error


def test_code_tasks_need_the_opt_in(setup, capsys):
    arguments = [
        "lm-eval",
        "--model",
        "composed",
        "--model_args",
        f"base={setup['root'] / 'base'},experts={setup['root'] / 'same'}",
        "--tasks",
        "tiny_unsafe",
        "--include_path",
        str(setup["tasks"]),
        "--device",
        "cpu",
    ]
    assert main(arguments) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and error[0].startswith("mergecompose lm-eval: error:") and "unsafe" in error[0].lower(), (
        error
    )
    out = setup["root"] / "unsafe_out"
    assert main([*arguments, "--confirm_run_unsafe_code", "--output_path", str(out)]) == 0


def test_the_cli_runs_a_task_end_to_end(setup, capfd, monkeypatch):
    """With `--quiet`, only the results table: no log line, bar or `git describe` complaint (run outside git)."""
    monkeypatch.chdir(setup["root"])
    out = setup["root"] / "cli_out"
    arguments = [
        "lm-eval",
        "--model",
        "composed",
        "--model_args",
        f"base={setup['root'] / 'base'},experts={setup['adapters']['ab']}|{setup['adapters']['cd']}",
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(setup["tasks"]),
        "--output_path",
        str(out),
        "--log_samples",
        "--device",
        "cpu",
        "--quiet",
    ]
    capfd.readouterr()
    assert main(arguments) == 0
    printed = capfd.readouterr()
    assert "tiny_mc" in printed.out and "acc" in printed.out
    assert printed.err == "", printed.err[-500:]
    assert list(out.rglob("results_*.json")) and list(out.rglob("samples_tiny_mc_*.jsonl"))
