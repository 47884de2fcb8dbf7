"""Every speed choice of a composition is made by timing on the machine (kernels/stopwatch.py), never by CPU family.

A fake stopwatch that says one option is faster makes that option the one chosen: packed or dense weights, each
few-row kernel, mixing before the output layer or not; and whatever is chosen, the composition decodes the same
tokens. A caller inside `torch.inference_mode` still gets one packed product per group of siblings."""

from __future__ import annotations

import weakref

import pytest
import torch

from mergecompose.composition import ComposedLM
from mergecompose.composition.kernels.few_row_kernel import TUNED_ROWS, FewRowKernel
from mergecompose.composition.kernels.few_row_linear import FewRowLinears
from mergecompose.composition.kernels.packed_weights import PACKED, PackedGroup
from mergecompose.composition.kernels.stacked_lora import StackedLoRA
from mergecompose.composition.kernels.stopwatch import Stopwatch, best, fastest, timed_runs
from mergecompose.core.adapters import load_adapters_on_base
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


class Prefers(Stopwatch):
    """A fake stopwatch: every run of `option` takes 1 s, of anything else 2 s; it records what it timed."""

    def __init__(self, option: str) -> None:
        self.option = option
        self.timed: list[str] = []

    def measure(self, option, run):
        self.timed.append(option)
        return run(), 1.0 if option == self.option else 2.0


def _adapters(lora_dirs):
    return {name: str(folder) for name, folder in lora_dirs.items()}


def _packed_modules(model):
    return [name for name, module in model.named_modules() if PACKED in module.__dict__]


@pytest.mark.parametrize("preferred", ["a", "b", "c"])
def test_the_option_timed_fastest_is_chosen_after_interleaved_rounds(preferred):
    runs = []
    options = {name: (lambda name=name: runs.append(name)) for name in "abc"}
    stopwatch = Prefers(preferred)
    choice = fastest(options, stopwatch, repeats=3)
    assert choice.chosen == preferred
    assert runs == list("abc") * 4  # a warm-up of each, then 3 rounds, one run of each in turn
    assert stopwatch.timed == list("abc") * 3  # the warm-up is not timed
    assert choice.summary() == {
        "chosen": preferred,
        "best_ms": {name: 1000.0 if name == preferred else 2000.0 for name in "abc"},
    }


def test_the_smallest_best_time_wins_and_ties_go_to_the_first():
    assert best({"x": [5.0, 1.0], "y": [1.5, 1.4]}).chosen == "x"  # one slow run does not count against x
    assert best({"x": [2.0], "y": [2.0]}).chosen == "x"
    with pytest.raises(ValueError, match="repeats >= 1, got 1 options, repeats=0"):
        timed_runs({"x": lambda: None}, Stopwatch(), repeats=0)


def test_the_real_stopwatch_times_a_run_and_returns_its_result():
    result, seconds = Stopwatch().measure("sleep", lambda: torch.ones(2).sum().item())
    assert result == 2.0 and seconds >= 0.0


@needs_onednn
@pytest.mark.parametrize("preferred", ["packed", *FewRowKernel.KERNELS])
def test_the_weights_are_packed_only_where_packing_timed_faster(tiny_config, lora_dirs, preferred):
    base = random_llama(tiny_config, seed=0)
    before = {name: parameter.detach().clone() for name, parameter in base.named_parameters()}
    peft_model, names = load_adapters_on_base(base, _adapters(lora_dirs))
    stopwatch = Prefers(preferred)
    stacked = StackedLoRA(peft_model, names, stopwatch=stopwatch)
    choice = stacked.linears.packing
    assert choice is not None and choice.chosen == preferred
    assert set(choice.seconds) == {"packed", *FewRowKernel.KERNELS}
    assert all(len(times) == 5 for times in choice.seconds.values())
    packed = _packed_modules(stacked.model)
    if preferred == "packed":
        assert len(packed) == 14 and stacked.linears.packed  # 2 layers x 7 projections
    else:  # packed for the trial, then given back dense, bit for bit
        assert packed == [] and not stacked.linears.packed
        for name, parameter in stacked.model.named_parameters():
            assert torch.equal(parameter, before[name]), name
    stacked.close()


@needs_onednn
def test_a_fixed_choice_is_not_timed(tiny_config, lora_dirs):
    for pack in (True, False):
        peft_model, names = load_adapters_on_base(random_llama(tiny_config, seed=0), _adapters(lora_dirs))
        stopwatch = Prefers("packed")
        stacked = StackedLoRA(peft_model, names, pack=pack, stopwatch=stopwatch)
        assert stacked.linears.packing is None and stopwatch.timed == []
        assert bool(_packed_modules(stacked.model)) is pack
        stacked.close()


@needs_onednn
def test_a_composition_decodes_the_same_tokens_packed_or_dense(tiny_config, lora_dirs):
    ids, mask = left_padded_batch([6, 4], seed=7)
    kwargs = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    tokens = {}
    for pack in (True, False, None):
        with ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights=pack) as lm:
            tokens[pack] = lm.generate(ids, mask, **kwargs)
            if pack is None:  # measured: the choice is reported
                assert lm.speed_choices["packed weights"]["chosen"] in ("packed", *FewRowKernel.KERNELS)
    assert torch.equal(tokens[True], tokens[False]) and torch.equal(tokens[None], tokens[True])


def test_pack_weights_must_be_a_boolean_or_none(tiny_config, lora_dirs):
    with pytest.raises(ValueError, match="`pack_weights` must be True, False or None \\(measure\\), got 'yes'"):
        ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights="yes")


@pytest.mark.parametrize("preferred", FewRowKernel.KERNELS)
def test_the_few_row_kernel_timed_faster_serves_the_decoding_steps(tiny_config, lora_dirs, preferred):
    """Dense weights: every decoding pass computes its linears with a few-row kernel, the one the stopwatch prefers."""
    lm = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights=False)
    stacked = lm.backend.stacked
    stopwatch = Prefers(preferred)
    stacked.few_rows = FewRowKernel(stopwatch=stopwatch)
    ids, mask = left_padded_batch([6, 4], seed=5)
    lm.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    rows = 3 * ids.shape[0]  # (k+1)·B rows at a decoding step
    assert stacked.few_rows.chosen[rows] == preferred
    assert set(stopwatch.timed) == set(FewRowKernel.KERNELS)
    assert lm.speed_choices["few-row kernel"][rows] == preferred
    lm.close()


class _HeadRows:
    """The row counts the output layer ran over."""

    def __init__(self, model):
        self.rows: list[int] = []
        head = model.get_output_embeddings()
        self.handle = head.register_forward_hook(lambda module, args, output: self.rows.append(args[0].shape[0]))


@pytest.mark.parametrize("preferred", ["mixed", "per component"])
def test_mixing_before_the_head_is_chosen_by_timing_at_each_batch_size(tiny_config, lora_dirs, preferred):
    lm = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs))
    lm.stopwatch = Prefers(preferred)
    ids, mask = left_padded_batch([6, 4], seed=5)
    kwargs = dict(max_new_tokens=6, eos_token_id=[], pad_token_id=PAD)
    head = _HeadRows(lm.base_model)
    tokens = lm.generate(ids, mask, **kwargs)
    head.handle.remove()
    assert lm.speed_choices["mixed head"][2]["chosen"] == preferred
    # A mixed pass runs the output layer over the B mixed rows; otherwise over every component's, (k+1)·B. (A row of
    # 1: the one-time check that the model's logits are its output layer's, `head_is_last`.)
    assert set(head.rows) - {1} == ({2} if preferred == "mixed" else {6})
    lm.generate(ids[:1], mask[:1], **kwargs)
    assert set(lm.speed_choices["mixed head"]) == {1, 2}  # each batch size is timed once, on its first call
    lm.mix_before_head = preferred != "mixed"  # the other way, fixed: the same tokens
    torch.testing.assert_close(lm.generate(ids, mask, **kwargs), tokens, rtol=0, atol=0)
    lm.close()


@needs_onednn
def test_inside_inference_mode_siblings_still_share_one_product(tiny_config, lora_dirs, monkeypatch):
    """Inside `torch.inference_mode` a composition runs as many oneDNN products as outside it (each group of
    siblings one, not one a sibling), and decodes the same tokens."""
    lm = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), _adapters(lora_dirs), pack_weights=True)
    ids, mask = left_padded_batch([6, 4], seed=5)
    kwargs = dict(max_new_tokens=6, eos_token_id=[], pad_token_id=PAD)
    products = []
    linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: products.append(1) or linear(*args))

    def run():
        products.clear()
        tokens, logprobs = lm.generate(ids, mask, **kwargs), lm.logprobs(ids, mask)
        return tokens, logprobs, len(products)

    lm.mix_before_head = True  # no trials: every run computes the same products
    kernel = lm.backend.stacked.few_rows = FewRowKernel()
    kernel.chosen.update(dict.fromkeys(TUNED_ROWS, "x_wt"))
    run()  # the first call checks once that the model's logits are its output layer's (a pass of its own)
    outside = run()
    with torch.inference_mode():
        ids, mask = ids.clone(), mask.clone()  # inference tensors
        inside = run()
    assert torch.equal(inside[0], outside[0]) and not inside[0].is_inference()
    torch.testing.assert_close(inside[1], outside[1])
    # 7 passes (the prompt, 5 steps, the teacher-forced one), each 2 layers x 4 packed products and the output
    # layer's dense oneDNN product.
    assert inside[2] == outside[2] == 7 * 2 * 4 + 7
    lm.close()


@needs_onednn
def test_few_row_linears_measure_packing_on_any_model(tiny_config):
    """`FewRowLinears` alone (no LoRA): the packing trial times every linear of the model, dense and packed."""
    model = random_llama(tiny_config, seed=0)
    linears = [(module, None) for module in model.modules() if type(module) is torch.nn.Linear]
    chosen = FewRowLinears(linears, pack_model=model, stopwatch=Prefers("packed"))
    assert chosen.packing.chosen == "packed" and len(_packed_modules(model)) == 14
    chosen.close()
    dense = FewRowLinears(linears, pack_model=model, stopwatch=Prefers("w_xt"))
    assert dense.packing.chosen == "w_xt" and _packed_modules(model) == []
    dense.close()


@needs_onednn
def test_weights_given_back_dense_hold_one_packed_group_at_a_time(tiny_config, monkeypatch):
    """When the trial chooses dense weights, each packed group is made dense once and let go before the next: the
    two layouts are never both held for the whole model (a peak of twice the weights' memory)."""
    model = random_llama(tiny_config, seed=0)
    linears = [(module, None) for module in model.modules() if type(module) is torch.nn.Linear]
    groups = weakref.WeakSet()
    alive = []  # the groups still alive as each group is made dense
    init, dense = PackedGroup.__init__, PackedGroup.dense

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        groups.add(self)

    def recorded_dense(self):
        alive.append(len(groups))
        return dense(self)

    monkeypatch.setattr(PackedGroup, "__init__", recorded_init)
    monkeypatch.setattr(PackedGroup, "dense", recorded_dense)
    chosen = FewRowLinears(linears, pack_model=model, stopwatch=Prefers("w_xt"))
    assert chosen.packing.chosen == "w_xt" and _packed_modules(model) == []
    assert alive == [4, 3, 2, 1]  # 2 layers x (q/k/v, gate/up), each made dense once
    chosen.close()
