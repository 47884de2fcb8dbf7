"""In-memory merge methods: golden values by hand, invariants, errors, and each variant pinned
against the library that defines it (peft's merge_utils, mergekit's merge_tensors) on the same
random tensors."""

import copy

import pytest
import torch
from mergekit.merge_methods import GeneralizedTaskArithmeticMerge, merge_tensors
from mergekit.merge_methods.generalized_task_arithmetic import ConsensusMethod
from mergekit.sparsify import SparsificationMethod
from peft.utils import merge_utils

from mergecompose.merging import MERGEKIT_MODE, METHODS, PEFT_MODE, TaskVector, merge, register
from mergecompose.merging.sparsify import magnitude_trim, magnitude_trim_global

EVERY_ENTRY = {
    "ties": {"density": 1.0},
    "magnitude_prune": {"density": 1.0},
    "breadcrumbs": {"density": 1.0},
    "dare_linear": {"drop_rate": 0.0},
    "dare_ties": {"drop_rate": 0.0},
}


def _merge(method, base, inputs, **params):
    return merge(method, base, inputs, progress=False, **params)


# ---- golden values ---------------------------------------------------------------------------

# Two task vectors over two tensors, zero base, so merged tensors are the merged deltas.
BASE = {"a": torch.zeros(2), "b": torch.zeros(2)}
TAU_1 = TaskVector({"a": torch.tensor([4.0, -1.0]), "b": torch.tensor([0.5, -3.0])})
TAU_2 = TaskVector({"a": torch.tensor([-2.0, 3.0]), "b": torch.tensor([1.0, 0.1])})


def test_task_arithmetic_golden():
    # θ = λ (w1 τ1 + w2 τ2) = 2 · (τ1 + 0.5 τ2)
    merged = _merge("task_arithmetic", BASE, [TAU_1, TAU_2], weights=[1.0, 0.5], lam=2.0)
    torch.testing.assert_close(merged["a"], torch.tensor([6.0, 1.0]))
    torch.testing.assert_close(merged["b"], torch.tensor([2.0, -5.9]))


def test_ties_paper_global_golden():
    # Global trim at density 0.5 keeps 2 of 4 entries per task vector:
    #   τ1: |4|, |−3| -> a=(4, 0), b=(0, −3);  τ2: |3|, |−2| -> a=(−2, 3), b=(0, 0).
    # Elected signs sgn(τ̂1 + τ̂2): a=(+, +), b=(+ [0 -> +], −).
    # Disjoint mean over agreeing non-zero entries: a=(4/1, 3/1), b=(0, −3/1).
    merged = _merge("ties", BASE, [TAU_1, TAU_2], density=0.5)
    torch.testing.assert_close(merged["a"], torch.tensor([4.0, 3.0]))
    torch.testing.assert_close(merged["b"], torch.tensor([0.0, -3.0]))


def test_ties_per_tensor_golden():
    # Per tensor, density 0.5 keeps 1 of 2 entries: τ1 a=(4, 0), b=(0, −3); τ2 a=(0, 3), b=(1, 0).
    merged = _merge("ties", BASE, [TAU_1, TAU_2], density=0.5, trim_scope="per_tensor")
    torch.testing.assert_close(merged["a"], torch.tensor([4.0, 3.0]))
    torch.testing.assert_close(merged["b"], torch.tensor([1.0, -3.0]))


def test_ties_paper_and_mergekit_consensus_golden():
    # Weights (1, 3), global trim as above: τ̂1 a=(4, 0), τ̂2 a=(−2, 3).
    # paper: sign of τ̂1 + τ̂2 at a0 is + -> only τ1 agrees: 1·4 / count 1 = 4; a1: 3·3 / 1 = 9.
    # mergekit: sign of 1·4 + 3·(−2) = −2 is − -> only τ2 agrees: 3·(−2) / weight 3 = −2; a1: 9 / 3 = 3.
    paper = _merge("ties", BASE, [TAU_1, TAU_2], density=0.5, weights=[1.0, 3.0])
    mergekit = _merge("ties", BASE, [TAU_1, TAU_2], density=0.5, weights=[1.0, 3.0], consensus="mergekit")
    torch.testing.assert_close(paper["a"], torch.tensor([4.0, 9.0]))
    torch.testing.assert_close(mergekit["a"], torch.tensor([-2.0, 3.0]))
    torch.testing.assert_close(paper["b"], torch.tensor([0.0, -3.0]))
    torch.testing.assert_close(mergekit["b"], torch.tensor([0.0, -3.0]))


def test_ties_sign_election_by_count_golden():
    # Three task vectors, one entry: (1, 1, −5). By mass the sign is −, by count +.
    base = {"x": torch.zeros(1)}
    inputs = [TaskVector({"x": torch.tensor([v])}) for v in (1.0, 1.0, -5.0)]
    by_mass = _merge("ties", base, inputs, density=1.0)
    by_count = _merge("ties", base, inputs, density=1.0, sign_election="count")
    torch.testing.assert_close(by_mass["x"], torch.tensor([-5.0]))
    torch.testing.assert_close(by_count["x"], torch.tensor([1.0]))


def test_linear_golden():
    # (1·(1, 2) + 3·(3, 6)) / 4 = (2.5, 5); not normalised: (10, 20).
    base = {"w": torch.tensor([100.0, 100.0])}
    models = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}]
    torch.testing.assert_close(_merge("linear", base, models, weights=[1.0, 3.0])["w"], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(
        _merge("linear", base, models, weights=[1.0, 3.0], normalize=False)["w"], torch.tensor([10.0, 20.0])
    )


def test_magnitude_prune_and_breadcrumbs_golden():
    base = {"w": torch.zeros(10)}
    tau = TaskVector({"w": torch.tensor([1.0, -2, 3, -4, 5, -6, 7, -8, 9, -10])})
    # magnitude_prune, density 0.3: keep −10, 9, −8.
    pruned = _merge("magnitude_prune", base, [tau], density=0.3)["w"]
    torch.testing.assert_close(pruned, torch.tensor([0.0, 0, 0, 0, 0, 0, 0, -8, 9, -10]))
    # breadcrumbs, density 0.5, gamma 0.1: drop the top 1 (−10), keep the next 5 (9..5), zero 4..1.
    crumbs = _merge("breadcrumbs", base, [tau], density=0.5, gamma=0.1)["w"]
    torch.testing.assert_close(crumbs, torch.tensor([0.0, 0, 0, 0, 5, -6, 7, -8, 9, 0]))


def test_dare_keeps_or_rescales_each_entry():
    torch.manual_seed(0)
    tau = TaskVector({"w": torch.randn(4000)})
    merged = _merge("dare_linear", {"w": torch.zeros(4000)}, [tau], drop_rate=0.75, seed=1)["w"]
    kept = merged != 0
    torch.testing.assert_close(merged[kept], tau.tensors["w"][kept] / 0.25)  # 1/(1 − p)
    assert 0.22 < kept.float().mean().item() < 0.28
    l1 = _merge("dare_linear", {"w": torch.zeros(4000)}, [tau], drop_rate=0.75, seed=1, rescale="l1")["w"]
    torch.testing.assert_close(l1.abs().sum(), tau.tensors["w"].abs().sum())  # L1 norm kept
    assert torch.equal(l1 != 0, kept)  # same seed, same mask


def test_dare_is_unbiased_and_seeded():
    tau = TaskVector({"w": torch.tensor([1.0, -2.0, 0.5])})
    base = {"w": torch.zeros(3)}
    mean = sum(_merge("dare_linear", base, [tau], drop_rate=0.5, seed=seed)["w"] for seed in range(400)) / 400
    torch.testing.assert_close(mean, tau.tensors["w"], atol=0.25, rtol=0)
    first = _merge("dare_ties", base, [tau, tau * 2.0], drop_rate=0.5, seed=7)["w"]
    assert torch.equal(first, _merge("dare_ties", base, [tau, tau * 2.0], drop_rate=0.5, seed=7)["w"])


def test_global_trim_on_one_tensor_equals_per_tensor_trim():
    torch.manual_seed(3)
    tensor = torch.randn(7, 9)
    torch.testing.assert_close(magnitude_trim_global({"t": tensor}, 0.3)["t"], magnitude_trim(tensor, 0.3))
    # Over two tensors the global trim keeps exactly ⌊0.3 · n⌋ entries in total.
    two = magnitude_trim_global({"t": tensor, "u": 3 * torch.randn(20)}, 0.3)
    assert sum(int((value != 0).sum()) for value in two.values()) == int(0.3 * (63 + 20))


# ---- invariants ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(METHODS))
def test_merging_one_model_returns_it(method, base_model, expert_models):
    merged = _merge(method, base_model, [expert_models[0]], **EVERY_ENTRY.get(method, {}))
    for name, tensor in expert_models[0].state_dict().items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=1e-6)


def test_density_one_is_a_no_op(base_model, expert_models):
    weights = [0.3, 0.9]
    # magnitude_prune at density 1 is task arithmetic.
    without_trim = _merge("task_arithmetic", base_model, expert_models, weights=weights)
    pruned = _merge("magnitude_prune", base_model, expert_models, weights=weights, density=1.0)
    assert all(torch.equal(pruned[name], without_trim[name]) for name in without_trim)
    # ties at density 1 is the sign election and disjoint mean of the untrimmed task vectors.
    task_vectors = [TaskVector.from_models(base_model, model) for model in expert_models]
    for scope in ("global", "per_tensor"):
        merged = _merge("ties", base_model, expert_models, weights=weights, density=1.0, trim_scope=scope)
        for name, tensor in base_model.state_dict().items():
            stacked = torch.stack([tau.tensors[name] for tau in task_vectors])  # (2, *shape)
            agrees = merge_utils.calculate_majority_sign_mask(stacked)
            weighted = stacked * torch.tensor(weights).reshape(-1, *([1] * tensor.dim()))
            expected = tensor + merge_utils.disjoint_merge(weighted, agrees)
            torch.testing.assert_close(merged[name], expected, atol=1e-6, rtol=0)


def test_identical_experts_give_that_expert(base_model, expert_models):
    expert = expert_models[0]
    for method, params in [("ties", {"density": 1.0}), ("linear", {}), ("dare_ties", {"drop_rate": 0.0})]:
        merged = _merge(method, base_model, [expert, copy.deepcopy(expert), expert.state_dict()], **params)
        for name, tensor in expert.state_dict().items():
            torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_inputs_are_not_mutated(method, base_model, expert_models):
    base_before = {name: tensor.clone() for name, tensor in base_model.state_dict().items()}
    expert_before = [{name: tensor.clone() for name, tensor in model.state_dict().items()} for model in expert_models]
    task_vector = TaskVector.from_models(base_model, expert_models[1])
    vector_before = {name: tensor.clone() for name, tensor in task_vector.tensors.items()}
    params = {
        "ties": {"density": 0.3},
        "magnitude_prune": {"density": 0.3},
        "breadcrumbs": {"density": 0.3},
        "dare_linear": {"drop_rate": 0.5},
        "dare_ties": {"drop_rate": 0.5},
    }.get(method, {})
    merged = _merge(method, base_model, [expert_models[0], task_vector], **params)
    merged["lm_head.weight"].add_(1.0)  # the result does not alias the base
    for name, tensor in base_model.state_dict().items():
        assert torch.equal(tensor, base_before[name])
    for model, before in zip(expert_models, expert_before):
        assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    assert all(torch.equal(tensor, vector_before[name]) for name, tensor in task_vector.tensors.items())


def test_result_loads_into_the_model(base_model, expert_models, tiny_config):
    from mergecompose.core.tiny import random_llama

    merged = _merge("ties", base_model, expert_models, density=0.2)
    model = random_llama(tiny_config, seed=5)
    model.load_state_dict(merged)
    assert set(merged) == set(base_model.state_dict())
    assert all(merged[name].dtype == tensor.dtype for name, tensor in base_model.state_dict().items())


def test_bf16_inputs_are_merged_in_float32_and_cast_back():
    base = {"w": torch.tensor([1.0, 2.0]).to(torch.bfloat16), "step": torch.tensor(3)}
    expert = {"w": torch.tensor([1.5, 2.5]).to(torch.bfloat16), "step": torch.tensor(3)}
    merged = _merge("task_arithmetic", base, [expert], lam=2.0)
    assert merged["w"].dtype == torch.bfloat16 and torch.equal(merged["w"], torch.tensor([2.0, 3.0]).to(torch.bfloat16))
    assert torch.equal(merged["step"], torch.tensor(3))  # integer buffer copied from the base


# ---- each variant against its library ----------------------------------------------------------

SHAPES = {"a": (16, 8), "b": (40,), "c": (5, 6, 3)}
WEIGHTS = [0.8, 0.5, 1.2]


@pytest.fixture(scope="module")
def random_tensors():
    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    task_vectors = [{name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()} for _ in range(3)]
    finetuned = [{name: base[name] + tau[name] for name in SHAPES} for tau in task_vectors]
    return base, task_vectors, finetuned


def _peft(function, task_vectors, *args, seed=None):
    if seed is not None:
        torch.manual_seed(seed)  # peft draws DARE masks from the global generator
    return {name: function([tau[name] for tau in task_vectors], torch.tensor(WEIGHTS), *args) for name in SHAPES}


def _assert_equal(ours, reference, atol=0.0):
    for name in SHAPES:
        torch.testing.assert_close(ours[name], reference[name], atol=atol, rtol=0)


@pytest.mark.parametrize(
    "method, params, peft_function, peft_args, seed",
    [
        ("task_arithmetic", {}, merge_utils.task_arithmetic, (), None),
        ("ties", {"density": 0.4}, merge_utils.ties, (0.4, "total"), None),
        ("ties", {"density": 0.4, "sign_election": "count"}, merge_utils.ties, (0.4, "frequency"), None),
        ("magnitude_prune", {"density": 0.4}, merge_utils.magnitude_prune, (0.4,), None),
        ("dare_linear", {"drop_rate": 0.6, "seed": 3}, merge_utils.dare_linear, (0.4,), 3),
        ("dare_ties", {"drop_rate": 0.6, "seed": 3}, merge_utils.dare_ties, (0.4, "total"), 3),
        (
            "dare_ties",
            {"drop_rate": 0.6, "seed": 5, "sign_election": "count"},
            merge_utils.dare_ties,
            (0.4, "frequency"),
            5,
        ),
    ],
)
def test_peft_mode_matches_peft_merge_utils(random_tensors, method, params, peft_function, peft_args, seed):
    _, task_vectors, _ = random_tensors
    zero_base = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    ours = _merge(method, zero_base, [TaskVector(tau) for tau in task_vectors], weights=WEIGHTS, **params, **PEFT_MODE)
    _assert_equal(ours, _peft(peft_function, task_vectors, *peft_args, seed=seed))


@pytest.mark.parametrize(
    "method, params, mergekit_parameters, seed",
    [
        ("task_arithmetic", {"lam": 1.3}, {"lambda": 1.3}, None),
        ("task_arithmetic", {"lam": 1.3, "normalize": True}, {"lambda": 1.3, "normalize": True}, None),
        ("ties", {"density": 0.4, "lam": 1.3}, {"density": 0.4, "lambda": 1.3}, None),
        ("ties", {"density": 0.4, "normalize": False}, {"density": 0.4, "normalize": False}, None),
        ("dare_linear", {"drop_rate": 0.6, "lam": 1.3, "seed": 4}, {"density": 0.4, "lambda": 1.3}, 4),
        ("dare_ties", {"drop_rate": 0.6, "lam": 1.3, "seed": 4}, {"density": 0.4, "lambda": 1.3}, 4),
        ("breadcrumbs", {"density": 0.6, "gamma": 0.05}, {"density": 0.6, "gamma": 0.05}, None),
    ],
)
def test_mergekit_mode_matches_mergekit_merge_tensors(random_tensors, method, params, mergekit_parameters, seed):
    base, _, finetuned = random_tensors
    ours = _merge(method, base, finetuned, weights=WEIGHTS, **params, **MERGEKIT_MODE)
    if seed is not None:
        torch.manual_seed(seed)  # mergekit draws DARE masks from the global generator, tensor by tensor
    reference = {
        name: merge_tensors(
            [base[name]] + [model[name] for model in finetuned],
            method,
            parameters={"weight": WEIGHTS, **mergekit_parameters},
            base_index=0,
        )
        for name in SHAPES
    }
    _assert_equal(ours, reference)


def test_mergekit_mode_count_election_matches_mergekit(random_tensors):
    base, _, finetuned = random_tensors
    ties_by_count = GeneralizedTaskArithmeticMerge(
        consensus_method=ConsensusMethod.count,
        sparsification_method=SparsificationMethod.magnitude,
        default_normalize=True,
        default_rescale=False,
        method_name="ties_count",
        method_pretty_name=None,
        method_reference_url=None,
    )
    ours = _merge("ties", base, finetuned, weights=WEIGHTS, density=0.3, sign_election="count", **MERGEKIT_MODE)
    reference = {
        name: merge_tensors(
            [base[name]] + [m[name] for m in finetuned],
            ties_by_count,
            parameters={"weight": WEIGHTS, "density": 0.3},
            base_index=0,
        )
        for name in SHAPES
    }
    _assert_equal(ours, reference)


def test_linear_matches_mergekit_linear(random_tensors):
    base, _, finetuned = random_tensors
    ours = _merge("linear", base, finetuned, weights=WEIGHTS)
    reference = {
        name: merge_tensors([model[name] for model in finetuned], "linear", parameters={"weight": WEIGHTS})
        for name in SHAPES
    }
    _assert_equal(ours, reference, atol=1e-6)  # θ_b + Σwτ/Σw vs Σwθ/Σw: rounding only


def test_paper_default_differs_from_both_libraries(random_tensors):
    base, _, finetuned = random_tensors
    paper = _merge("ties", base, finetuned, weights=WEIGHTS, density=0.3)
    mergekit = _merge("ties", base, finetuned, weights=WEIGHTS, density=0.3, **MERGEKIT_MODE)
    peft = _merge("ties", base, finetuned, weights=WEIGHTS, density=0.3, **PEFT_MODE)
    assert all(not torch.allclose(paper[name], mergekit[name]) for name in SHAPES)
    assert any(not torch.allclose(paper[name], peft[name]) for name in SHAPES)


# ---- errors ------------------------------------------------------------------------------------


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown merge method 'tie'.*'task_arithmetic'.*'ties'"):
        _merge("tie", BASE, [TAU_1])


@pytest.mark.parametrize(
    "method, params, message",
    [
        ("ties", {"density": 1.5}, r"`density` must be in \(0, 1\], got 1.5"),
        ("ties", {"density": 0.0}, r"`density` must be in \(0, 1\], got 0.0"),
        ("ties", {}, r"`ties` needs `density`"),
        ("dare_ties", {"drop_rate": 1.0}, r"`drop_rate` must be in \[0, 1\), got 1.0"),
        ("dare_linear", {}, r"needs `drop_rate`"),
        ("dare_linear", {"drop_rate": 0.5, "density": 0.5}, r"not both"),
        ("ties", {"density": 0.5, "lam": -1.0}, r"`lam` must be > 0 for `ties`.*got -1.0"),
        ("task_arithmetic", {"density": 0.5}, r"`density` does not apply to `task_arithmetic`"),
        ("task_arithmetic", {"lam": float("nan")}, r"`lam` must be a finite real number"),
        ("linear", {"lam": 2.0}, r"`lam` does not apply to `linear`"),
        ("ties", {"density": 0.5, "consensus": "peft"}, r"`consensus` must be 'paper' or 'mergekit', got 'peft'"),
        (
            "ties",
            {"density": 0.5, "trim_scope": "layer"},
            r"`trim_scope` must be 'global' or 'per_tensor', got 'layer'",
        ),
        ("breadcrumbs", {"density": 0.5, "trim_scope": "global"}, r"must be 'per_tensor' for `breadcrumbs`"),
        ("breadcrumbs", {"density": 0.5, "gamma": 1.0}, r"`gamma` must be in \[0, 1\), got 1.0"),
        ("task_arithmetic", {"weights": [1.0]}, r"`weights` must hold one weight per input \(2\), got \[1.0\]"),
        ("linear", {"weights": [1.0, -1.0]}, r"`weights` sum to 0"),
    ],
)
def test_bad_parameters_name_the_parameter_value_and_range(method, params, message):
    with pytest.raises(ValueError, match=message):
        _merge(method, BASE, [TAU_1, TAU_2], **params)


def test_mismatched_inputs_name_the_tensor_and_both_shapes():
    with pytest.raises(ValueError, match=r"finetuned_or_task_vectors\[1\].*`b`.*\(2,\).*\(3,\)"):
        _merge("task_arithmetic", BASE, [BASE, {"a": torch.zeros(2), "b": torch.zeros(3)}])
    with pytest.raises(ValueError, match=r"only in base: \['b'\]"):
        _merge("task_arithmetic", BASE, [{"a": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"`c`, which `base` does not have"):
        _merge("task_arithmetic", BASE, [TaskVector({"c": torch.zeros(2)})])
    with pytest.raises(ValueError, match=r"must be a list"):
        _merge("task_arithmetic", BASE, TAU_1)
    with pytest.raises(ValueError, match=r"at least one"):
        _merge("task_arithmetic", BASE, [])


def test_registry_refuses_duplicates_and_is_read_only():
    with pytest.raises(ValueError, match=r"`ties` is already registered"):
        register(METHODS["ties"])
    with pytest.raises(TypeError):
        METHODS["ties"] = METHODS["linear"]
