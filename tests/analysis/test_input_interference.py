"""Input-space interference of LoRA experts (`mergecompose.analysis.input_interference`): the ratios by hand, the
updates against peft's own layer outputs, a layer one adapter does not adapt, and the base left as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mergecompose.analysis.input_interference import input_interference, interference_ratios, interference_summary
from mergecompose.analysis.predict import undefined_reasons, unlabelled_diagnostics
from mergecompose.composition import ComposedLM
from mergecompose.core.adapters import load_adapters_on_base


def test_ratios_and_summary_by_hand():
    sums = torch.tensor(
        [
            [[4.0, 1.0], [9.0, 9.0]],  # layer 0: ρ(0,1) = sqrt(1/4) = 0.5, ρ(1,0) = sqrt(9/9) = 1
            [[1.0, 4.0], [0.0, 0.0]],  # layer 1: ρ(0,1) = 2; expert 1 has no own update here: NaN
        ]
    )
    ratios = interference_ratios(sums)
    assert ratios[0].tolist() == [[1.0, 0.5], [1.0, 1.0]]
    assert ratios[1, 0].tolist() == [1.0, 2.0] and all(math.isnan(v) for v in ratios[1, 1].tolist())
    summary = interference_summary(ratios, ["a", "b"])
    assert summary["pairs"] == {"a→b": {"mean": 1.25, "max": 2.0}, "b→a": {"mean": 1.0, "max": 1.0}}
    assert summary["mean"] == pytest.approx(1.125) and summary["max"] == 2.0


def test_the_ratio_of_a_layer_nothing_adapts_is_undefined():
    ratios = interference_ratios(torch.zeros(1, 2, 2))
    assert all(math.isnan(v) for v in ratios.flatten().tolist())
    assert interference_summary(ratios, ["a", "b"]) == {
        "pairs": {"a→b": {"mean": None, "max": None}, "b→a": {"mean": None, "max": None}},
        "mean": None,
        "max": None,
    }


def _batches():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (2, 7), generator=generator)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding: those positions are not counted
    return [{"input_ids": ids, "attention_mask": mask}]


def _by_hand(base_model, lora_dirs, batches):
    """S_l[i, j] from peft's own layers: with adapter j active, its update on an input is the layer's output minus
    its base layer's; the inputs are captured in expert i's model."""
    model, names = load_adapters_on_base(copy.deepcopy(base_model), lora_dirs)
    layers = {name: module for name, module in model.named_modules() if hasattr(module, "lora_A") and module.lora_A}
    captured: dict = {}
    sums: dict = {}
    for i, expert in enumerate(names):
        model.set_adapter(expert)
        handles = [
            module.register_forward_pre_hook(lambda m, args, name=name: captured.__setitem__(name, args[0]))
            for name, module in layers.items()
        ]
        for batch in batches:
            model(**batch)
            mask = batch["attention_mask"].bool()
            for name, module in layers.items():
                rows = captured[name][mask]
                for j, other in enumerate(names):
                    if other not in module.lora_A:
                        continue
                    module.set_adapter(other)
                    update = module(rows) - module.get_base_layer()(rows)
                    module.set_adapter(expert)
                    key = (name.removeprefix("base_model.model."), i, j)
                    sums[key] = sums.get(key, 0.0) + float(update.double().square().sum())
        for handle in handles:
            handle.remove()
    return sums


def test_the_updates_are_peft_s_own_and_the_base_is_left_as_it_was(base_model, lora_dirs):
    before = {name: tensor.clone() for name, tensor in base_model.state_dict().items()}
    batches = _batches()
    report = input_interference(base_model, lora_dirs, batches)
    assert base_model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[name], tensor) for name, tensor in base_model.state_dict().items())

    sums = _by_hand(base_model, lora_dirs, batches)
    names = list(lora_dirs)
    for layer, ratios in report["ratios"].items():
        for i, j in ((0, 1), (1, 0)):
            own, other = sums.get((layer, i, i), 0.0), sums.get((layer, i, j), 0.0)
            expected = math.sqrt(other / own) if own > 0 else None
            got = ratios[f"{names[i]}→{names[j]}"]
            assert got == (None if expected is None else pytest.approx(expected, rel=1e-4)), (layer, i, j)
    # "cd" adapts q, v and down only: on the other layers its update is 0 and its own is absent.
    k_proj = next(layer for layer in report["layers"] if layer.endswith("k_proj"))
    assert report["ratios"][k_proj] == {"ab→cd": 0.0, "cd→ab": None}
    assert report["max"] >= report["mean"] > 0


def test_one_adapter_is_refused(base_model, lora_dirs):
    with pytest.raises(ValueError, match="two or more adapters, got 1"):
        input_interference(base_model, {"ab": lora_dirs["ab"]}, _batches())


def test_the_flat_diagnostics_of_lora_experts_and_why_full_ones_have_none(base_model, lora_dirs, batches):
    adapters = {name: str(path) for name, path in lora_dirs.items()}
    with ComposedLM.from_adapters(copy.deepcopy(base_model), adapters) as composed:
        flat, reports = unlabelled_diagnostics(composed, batches, adapters=(base_model, adapters))
        without, without_reports = unlabelled_diagnostics(composed, batches)
    measured = input_interference(base_model, adapters, batches)
    assert flat["lora_input_interference_mean"] == pytest.approx(measured["mean"])
    assert flat["lora_input_interference_max"] == pytest.approx(measured["max"])
    assert reports["input_interference"]["pairs"] == measured["pairs"]
    assert without["lora_input_interference_mean"] is None and without["lora_input_interference_max"] is None
    reasons = undefined_reasons(without, without_reports)
    assert reasons["lora_input_interference_max"].startswith("the experts are not all LoRA adapters")
