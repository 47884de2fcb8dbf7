"""peft's `add_weighted_adapter(..., combination_type="cat")` is task arithmetic on the LoRA deltas.

`cat` stacks the ranks, A = [λ_1 s_1 A_1; λ_2 s_2 A_2] and B = [B_1, B_2], so that B A = Σ_i λ_i s_i B_i A_i =
Σ_i λ_i ΔW_i: merged into the base, θ_base + Σ_i λ_i ΔW_i, which is `merge("task_arithmetic", ...)` of the
adapters' task vectors with weights λ_i. So scoring peft's `cat` beside task arithmetic in the study would score
the same model twice. Pinned weight by weight on the merged model's state dict, for adapters of different ranks,
scalings and target modules.
"""

from __future__ import annotations

import copy
import math

import peft
import pytest
import torch
from packaging.version import Version
from peft import LoraConfig, PeftModel, get_peft_model

from mergecompose.core.tiny import random_lora_adapter
from mergecompose.merging import TaskVector, merge

RANKS = (4, 2)


def _lora_adapter(base, out_dir, seed: int, use_rslora: bool = False):
    """Rank 2, alpha 6 (scaling 3, or 6/√2 with rsLoRA) on three of the seven projections, random A and B."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=RANKS[1],
        lora_alpha=6,
        use_rslora=use_rslora,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    get_peft_model(copy.deepcopy(base), config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(base_model, tmp_path_factory):
    """`a`: rank 4, scaling 1, all seven projections; `b`: rank 2, scaling 3, q, v and down only."""
    root = tmp_path_factory.mktemp("peft_cat")
    return {
        "a": random_lora_adapter(base_model, root / "a", seed=21, rank=RANKS[0]),
        "b": _lora_adapter(base_model, root / "b", seed=22),
    }


def peft_cat_merged(base, adapters, weights) -> dict[str, torch.Tensor]:
    """The state dict of `base` with peft's `cat` combination of `adapters` at `weights` merged in."""
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapters["a"]), adapter_name="a")
    peft_model.load_adapter(str(adapters["b"]), adapter_name="b")
    peft_model.add_weighted_adapter(["a", "b"], list(weights), "cat", combination_type="cat")
    assert peft_model.peft_config["cat"].r == sum(RANKS)  # the ranks stacked
    peft_model.set_adapter("cat")
    return peft_model.merge_and_unload(adapter_names=["cat"]).state_dict()


def assert_same_state_dict(result, expected) -> None:
    assert list(result) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(result[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("weights", [(0.4, 0.4), (1.5, -0.7)])
def test_peft_cat_is_task_arithmetic_on_the_lora_deltas(base_model, adapters, weights):
    task_vectors = [TaskVector.from_lora(base_model, adapters[name]) for name in ("a", "b")]
    expected = merge("task_arithmetic", base_model, task_vectors, weights=list(weights), progress=False)
    result = peft_cat_merged(base_model, adapters, weights)
    assert_same_state_dict(result, expected)
    if weights[0] == weights[1]:  # one λ for both: task arithmetic's own λ
        assert_same_state_dict(
            result, merge("task_arithmetic", base_model, task_vectors, lam=weights[0], progress=False)
        )
    # Not vacuous: both adapters count where both adapt (q_proj), one where only `a` does (k_proj), and the rest
    # of the base is unchanged.
    base = base_model.state_dict()
    q_proj, k_proj = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    only_a = base[q_proj] + weights[0] * task_vectors[0].tensors[q_proj]
    assert (result[q_proj] - only_a).abs().max() > 1e-2
    assert (result[k_proj] - base[k_proj]).abs().max() > 1e-2 and k_proj not in task_vectors[1].tensors
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(result[name], base[name])


PEFT_COPIES_RSLORA = Version(peft.__version__) < Version("0.22.0")  # fixed in peft 0.22.0 (issue #3761)


def test_peft_cat_after_an_rslora_adapter_is_task_arithmetic(base_model, adapters, tmp_path):
    """peft before 0.22 gives the combined adapter the first adapter's `use_rslora` with lora_alpha = r = Σ r_i,
    hence scaling √(Σ r_i) instead of 1 (peft issue #3761; `combine_lora_adapters` resets it): still task
    arithmetic, at λ √(Σ r_i). peft 0.22 combines with `use_rslora=False`: plain task arithmetic. Pinned for
    whichever peft is installed, and the two expectations differ (the first assertion)."""
    rslora = {"a": _lora_adapter(base_model, tmp_path / "rs", seed=23, use_rslora=True), "b": adapters["a"]}
    task_vectors = [TaskVector.from_lora(base_model, rslora[name]) for name in ("a", "b")]
    weights = [1.0, 0.5]
    result = peft_cat_merged(base_model, rslora, weights)
    scale = math.sqrt(sum(RANKS))
    plain = merge("task_arithmetic", base_model, task_vectors, weights=weights, progress=False)
    scaled = merge("task_arithmetic", base_model, task_vectors, weights=weights, lam=scale, progress=False)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert (scaled[q_proj] - plain[q_proj]).abs().max() > 1e-2
    assert_same_state_dict(result, scaled if PEFT_COPIES_RSLORA else plain)
