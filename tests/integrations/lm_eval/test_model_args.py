"""The `composed` model's model_args as lm-eval hands them over: typed values, lm-eval's own `batch_size` and
`device`, required and unknown names. Tiny local tasks only (lm-eval's own task index is never built)."""

from __future__ import annotations

import json
import os

import lm_eval
import pytest
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed`)
from mergecompose.analysis.data import char_tokenizer
from mergecompose.integrations.lm_eval.harness_model import MODEL_ARGS, ComposedModelArgs

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456 "  # 60 + 4 specials = vocab 64


@pytest.fixture(scope="module")
def folders(base_model, lora_dirs, tmp_path_factory):
    """A base checkpoint with a tokenizer, and one tiny multiple-choice task."""
    root = tmp_path_factory.mktemp("model_args")
    base_model.save_pretrained(root / "base")
    char_tokenizer(CHARACTERS).save_pretrained(root / "base")
    data = root / "data.jsonl"
    data.write_text("\n".join(json.dumps({"source": s, "choices": [s, s.lower()], "label": 1}) for s in ["AB", "CD"]))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{source}}="\ndoc_to_target: label\ndoc_to_choice: choices\n'
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n"
    )
    return {"base": str(root / "base"), "adapter": str(lora_dirs["ab"]), "tasks": tasks}


def test_a_single_weight_and_a_batch_size_as_lm_eval_types_them(folders):
    """`weights=0.5` arrives as a float and `batch_size=2` as an int, beside lm-eval's own batch_size and device."""
    string = f"base={folders['base']},experts={folders['adapter']},weights=0.5,batch_size=2"
    model = get_model("composed").create_from_arg_string(string, {"batch_size": 1, "device": "cpu"})
    assert model.composed.weights == [0.5]
    assert model.batch_size == 2  # model_args win over lm-eval's --batch_size
    dense = get_model("composed").create_from_arg_obj(
        {"base": folders["base"], "experts": [folders["adapter"]], "weights": 1}, {"batch_size": 3, "device": "cpu"}
    )
    assert dense.composed.weights == [1.0] and dense.batch_size == 3


def test_simple_evaluate_with_typed_model_args(folders):
    output = lm_eval.simple_evaluate(
        model="composed",
        model_args={"base": folders["base"], "experts": [folders["adapter"]], "weights": 0.5, "batch_size": 2},
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(folders["tasks"]), include_defaults=False),
        batch_size=1,
        device="cpu",
    )
    assert 0.0 <= output["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert output["config"]["batch_size"] == 1  # lm-eval records its own; the model ran with 2


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ({"experts": "x"}, r"model_args `base` \(a checkpoint folder or hub id \(required\)\) missing"),
        ({"base": "b"}, r"model_args `experts`"),
        ({"base": "b", "experts": "x", "nosuch_arg": 1}, r"no model_arg \['nosuch_arg'\]; valid model_args: \["),
        ({"base": "b", "experts": "x", "weigths": 1}, r"did you mean 'weights' for 'weigths'"),
        ({"base": "b", "experts": "x", "weights": True}, r"`weights` must be numbers .*got True"),
        ({"base": "b", "experts": "x", "weights": float("nan")}, r"`weights` must be numbers .*finite"),
        ({"base": "b", "experts": 3}, r"`experts` must list one or more entries .*got 3"),
        ({"base": "b", "experts": "x", "batch_size": "auto"}, r"`batch_size` must be a positive integer.*'auto'"),
        ({"base": "b", "experts": "x", "batch_size": 1.5}, r"`batch_size` must be a positive integer.*1\.5"),
        (
            {"base": "b", "experts": "x", "device": "gpu"},
            r"`device` must be 'cpu', 'cuda', 'cuda:N' or 'mps', got 'gpu'",
        ),
        ({"base": "b", "experts": "x", "lora_implementation": "x"}, r"`lora_implementation` must be one of"),
        ({"base": 5, "experts": "x"}, r"`base` must be a checkpoint folder or hub id"),
    ],
)
def test_bad_model_args_name_the_argument_value_and_what_is_allowed(model_args, message):
    with pytest.raises(ValueError, match=message):
        ComposedModelArgs.parse(model_args)


def test_unknown_names_list_every_valid_one():
    with pytest.raises(ValueError) as error:
        ComposedModelArgs.parse({"base": "b", "experts": "x", "nosuch_arg": 1})
    assert all(name in str(error.value) for name in MODEL_ARGS)


def test_lm_eval_none_means_not_given():
    args = ComposedModelArgs.parse({"base": "b", "experts": "x|y"}, {"batch_size": None, "device": None})
    assert (args.batch_size, args.device, args.experts) == (1, "cpu", ["x", "y"])
