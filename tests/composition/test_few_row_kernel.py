"""The few-row kernel of the shared base's linears (`FewRowKernel`, kernels/stacked_lora.py): chosen by timing, per
row count.

The policy on given timings; then a LoRA composition that decodes with each kernel forced gives the same
logits within float32 rounding, and one left to choose has chosen for its decoding steps' row count."""

from __future__ import annotations

import time

import pytest
import torch

from mergecompose.composition import ComposedLM
from mergecompose.composition.kernels import few_row_linear
from mergecompose.composition.kernels.few_row_kernel import FewRowKernel
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("faster", FewRowKernel.KERNELS)
def test_the_kernels_take_turns_then_the_faster_serves(faster):
    choice = FewRowKernel(trials=2)
    seen = []
    for _ in range(4):
        kernel = choice.kernel(3)
        assert choice.timing(3)
        seen.append(kernel)
        choice.record(3, kernel, 1.0 if kernel == faster else 2.0)
    assert seen == ["x_wt", "w_xt", "x_wt", "w_xt"]
    assert choice.chosen == {3: faster} and not choice.timing(3) and choice.kernel(3) == faster
    assert choice.timing(6) and choice.kernel(6) == "x_wt"  # each row count is chosen on its own


def test_the_smaller_best_time_wins_over_one_slow_trial():
    choice = FewRowKernel(trials=2)
    for kernel, seconds in (("x_wt", 5.0), ("w_xt", 1.5), ("x_wt", 1.0), ("w_xt", 1.4)):
        choice.record(3, kernel, seconds)
    assert choice.chosen == {3: "x_wt"}  # its first pass was slow (a warm-up), its best is the best


@pytest.fixture(scope="module")
def lora_composition(tiny_config, lora_dirs):
    """The base's linears left dense (not packed), so that every pass uses the kernel chosen for it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(few_row_linear, "can_pack", lambda weight: False)
        return ComposedLM.from_adapters(random_llama(tiny_config, seed=0), {k: str(v) for k, v in lora_dirs.items()})


def test_either_kernel_gives_the_same_logits_and_the_composition_chooses(lora_composition):
    backend = lora_composition.backend
    stacked = backend.stacked
    ids, mask = left_padded_batch([6, 4], seed=5)
    stacked.few_rows = FewRowKernel()
    lora_composition.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    rows = len(backend.components) * ids.shape[0]  # (k+1)·B rows in a decoding step
    assert rows in stacked.few_rows.chosen  # 7 decoding steps: 2 trials of each kernel, then the choice
    step = ids[:, -1:]  # (B, 1): a pass over one token a row has the decoding step's row count
    stacked.few_rows = FewRowKernel(trials=1)  # two trial passes, one with each kernel, each timed
    logits = [backend.forward(step, torch.ones_like(step), torch.zeros_like(step)) for _ in range(2)]  # (k+1, B, 1, V)
    seconds = stacked.few_rows.seconds[rows]
    assert {kernel: len(times) for kernel, times in seconds.items()} == {"x_wt": 1, "w_xt": 1}
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def _replaced(models):
    """The modules of `models` whose forward is an instance attribute (a replaced forward)."""
    return [name for model in models for name, module in model.named_modules() if "forward" in module.__dict__]


def test_full_experts_use_either_kernel_and_get_their_linears_back(tiny_config):
    """`SeparateModels` runs its models' linears with the few-row kernel: both kernels give the models' own
    logits within float32 rounding, a speculative run chooses one for its verification passes (B·(K+1) rows)
    and gives the draft's linears back, and `close()` gives every linear its own forward back."""
    models = [random_llama(tiny_config, seed=seed) for seed in (0, 1, 2)]
    lm = ComposedLM(models[0], models[1:])
    linears = lm.backend.linears
    assert len(_replaced(models)) == 3 * 15  # 7 projections in each of 2 layers and the output layer, per model
    ids, mask = left_padded_batch([6, 4], seed=5)
    step = ids[:, -1:]  # (B, 1)
    positions = torch.zeros_like(step)
    linears.kernel = FewRowKernel(trials=1)  # a pass per model: the base's pass with x @ Wᵀ, the experts' with W @ xᵀ
    logits = lm.backend.forward(step, torch.ones_like(step), positions)  # (k+1, B, 1, V)
    assert {kernel: len(times) for kernel, times in linears.kernel.seconds[2].items()} == {"x_wt": 1, "w_xt": 1}
    for _ in range(2):  # chosen: every model's pass with one kernel, then the other
        linears.kernel = FewRowKernel()
        linears.kernel.chosen[2] = "x_wt" if _ == 0 else "w_xt"
        again = lm.backend.forward(step, torch.ones_like(step), positions)
        torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        own = torch.stack([model(step, position_ids=positions).logits for model in models])  # plain F.linear
    torch.testing.assert_close(own, logits, rtol=1e-5, atol=1e-5)

    lm.generate(ids, mask, max_new_tokens=24, draft="merged", num_draft_tokens=3, adaptive_draft=False)
    assert ids.shape[0] * 4 in linears.kernel.chosen  # the target's verification passes: B·(K+1) rows
    assert _replaced([lm.merged_draft()]) == []  # the draft's linears were given back after the call
    lm.close()
    assert _replaced(models) == []
    torch.testing.assert_close(torch.stack([model(step, position_ids=positions).logits for model in models]), own)


def test_a_speculative_round_with_a_kernel_trial_is_not_timed(tiny_config, monkeypatch):
    """A trial of the slower few-row kernel can cost several plain passes; the adaptive K must not take the draft's
    cost from such a round, or an exact draft is dropped for plain steps (speculative/decoding.py)."""
    models = [random_llama(tiny_config, seed=0) for _ in range(3)]  # experts equal to the base: an exact draft
    lm = ComposedLM(models[0], models[1:])
    record = FewRowKernel.record

    def slow_trial(self, rows, kernel, seconds):
        time.sleep(0.05)  # called at the end of the trial pass: inside the round's time
        record(self, rows, kernel, seconds)

    monkeypatch.setattr(FewRowKernel, "record", slow_trial)
    before = FewRowKernel.trial_passes
    lm.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=40, draft="merged", num_draft_tokens=3)
    stats = lm.speculation_stats
    assert FewRowKernel.trial_passes > before  # the rounds did run trials
    assert stats.accepted == stats.tested > 0
    assert stats.plain_rounds <= 2, stats  # the second round is a plain step by design (speculative/draft_length.py)
