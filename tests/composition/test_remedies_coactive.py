"""Remedies for co-active experts: a shared delta counted once, and TIES's sign consensus per token."""

import math

import pytest
import torch
from peft import PeftModel

from mergecompose.composition import ComposedLM, RemedySettings, compose_logprobs, compose_with_remedies
from mergecompose.composition.remedies import (
    ActivityGate,
    PlausibilityFilter,
    SharedDelta,
    SignConsensus,
    TerminationRule,
    check_remedies,
    compose_with_remedies_unchecked,
)
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama


def log(values):
    return torch.tensor(values, dtype=torch.float64).log()


# ----------------------------------------------------------------------------- independent references


def naive_shared_delta(components, exponents):
    """`log p_b + (max_A w) · s + Σ_i w_i (d_i − [i∈A] s)`, token by token in float64 (finite inputs)."""
    logprobs = torch.log_softmax(components.double(), -1)  # (k+1, P, V)
    base, experts = logprobs[0], logprobs[1:]
    out = torch.empty_like(base)
    for position in range(base.shape[0]):
        sharers = [i for i in range(len(experts)) if exponents[i][position] > 0]
        for token in range(base.shape[1]):
            deltas = [float(experts[i, position, token] - base[position, token]) for i in range(len(experts))]
            shared = 0.0
            if sharers and all(deltas[i] > 0 for i in sharers):
                shared = min(deltas[i] for i in sharers)
            elif sharers and all(deltas[i] < 0 for i in sharers):
                shared = -min(-deltas[i] for i in sharers)
            score = float(base[position, token])
            if sharers:
                score += max(float(exponents[i][position]) for i in sharers) * shared
            for i, delta in enumerate(deltas):
                score += float(exponents[i][position]) * (delta - (shared if i in sharers else 0.0))
            out[position, token] = score
    return torch.log_softmax(out, -1)


def naive_sign_consensus(components, exponents, density):
    """Trim each expert's deltas to its ⌊density·V⌋ largest, elect a sign per token, sum the agreeing ones."""
    logprobs = torch.log_softmax(components.double(), -1)  # (k+1, P, V)
    base, experts = logprobs[0], logprobs[1:]
    vocab = base.shape[1]
    count = max(1, int(density * vocab))
    out = torch.empty_like(base)
    for position in range(base.shape[0]):
        kept_contributions = []
        for i in range(len(experts)):
            deltas = [float(experts[i, position, token] - base[position, token]) for token in range(vocab)]
            threshold = sorted((abs(d) for d in deltas), reverse=True)[count - 1]
            weight = float(exponents[i][position])
            kept_contributions.append([weight * d if abs(d) >= threshold else 0.0 for d in deltas])
        for token in range(vocab):
            contributions = [row[token] for row in kept_contributions]
            sign = 1.0 if sum(contributions) >= 0 else -1.0
            agreeing = sum(c for c in contributions if c * sign >= 0)
            out[position, token] = float(base[position, token]) + agreeing
    return torch.log_softmax(out, -1)


def random_components(k, seed, positions=6, vocab=16):
    generator = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(k + 1, positions, vocab, generator=generator)  # (k+1, P, V) logits


def per_position(weights, positions):
    return [[w] * positions for w in weights]


# ----------------------------------------------------------------------------- the definitions


def test_shared_delta_golden():
    """Two experts that both raise token 0 and both lower token 2: that change is applied once."""
    base = log([0.4, 0.3, 0.2, 0.1])
    expert_1 = log([0.6, 0.3, 0.05, 0.05])
    expert_2 = log([0.5, 0.1, 0.1, 0.3])
    components = torch.stack([base, expert_1, expert_2])
    d1, d2 = expert_1 - base, expert_2 - base
    # Token 0: both up, s = min = log(0.5/0.4); token 2: both down, s = −min|·| = log(0.1/0.2); tokens 1, 3: 0.
    shared = torch.tensor([math.log(0.5 / 0.4), 0.0, math.log(0.1 / 0.2), 0.0], dtype=torch.float64)
    expected = torch.log_softmax(base + shared + (d1 - shared) + (d2 - shared), -1)
    composed = compose_with_remedies(components, remedies=[SharedDelta()])
    torch.testing.assert_close(composed, expected.float())
    # The plain rule counts the shared change twice; here it is the plain rule minus one copy of it.
    plain = compose_logprobs(base, [expert_1, expert_2])
    torch.testing.assert_close(composed, torch.log_softmax(plain - shared.float(), -1))


@pytest.mark.parametrize("k, weights", [(2, [1.0, 1.0]), (3, [1.0, 0.5, 2.0]), (3, [0.7, -0.4, 1.3])])
def test_shared_delta_equals_the_naive_loop(k, weights):
    components = random_components(k, seed=k)
    composed = compose_with_remedies(components, weights, [SharedDelta()])
    expected = naive_shared_delta(components, per_position(weights, components.shape[1]))
    torch.testing.assert_close(composed.double(), expected, rtol=0, atol=2e-5)


def test_shared_delta_among_the_experts_a_gate_lets_through():
    """An expert gated off at a position shares nothing there: the naive loop with the gate's exponents."""
    components = random_components(3, seed=5)
    gate = ActivityGate(threshold=1.2)
    logprobs = torch.log_softmax(components, -1)
    active = gate.active(logprobs)  # (k, P)
    assert active.any() and not active.all()  # the gate does select
    weights = [1.0, 0.5, 2.0]
    exponents = (torch.tensor(weights)[:, None] * active).tolist()
    composed = compose_with_remedies(components, weights, [gate, SharedDelta()])
    torch.testing.assert_close(composed.double(), naive_shared_delta(components, exponents), rtol=0, atol=2e-5)


@pytest.mark.parametrize("density", [1.0, 0.5, 0.2])
@pytest.mark.parametrize("k, weights", [(2, [1.0, 1.0]), (3, [1.0, 0.5, 2.0]), (3, [0.7, -0.4, 1.3])])
def test_sign_consensus_equals_the_naive_loop(k, weights, density):
    components = random_components(k, seed=10 + k)
    composed = compose_with_remedies(components, weights, [SignConsensus(density)])
    expected = naive_sign_consensus(components, per_position(weights, components.shape[1]), density)
    torch.testing.assert_close(composed.double(), expected, rtol=0, atol=2e-5)
    if density == 1.0:  # conflicts were there to resolve: the result is not the plain rule
        assert not torch.allclose(composed, compose_with_remedies(components, weights), atol=1e-3)


@pytest.mark.parametrize("weight", [1.0, 0.6, -0.5, 2.5])
def test_one_expert_composes_as_the_plain_rule(weight):
    components = random_components(1, seed=21)
    plain = compose_with_remedies(components, [weight])
    for remedy in (SharedDelta(), SignConsensus()):
        torch.testing.assert_close(compose_with_remedies(components, [weight], [remedy]), plain)


def disjoint_experts():
    """Base and three experts whose deltas have disjoint support: each moves mass between its own two tokens."""
    base = torch.tensor([0.1, 0.2, 0.05, 0.15, 0.1, 0.1, 0.2, 0.1], dtype=torch.float64)
    experts = []
    for first, second, moved in [(0, 1, 0.08), (2, 3, -0.04), (4, 6, 0.05)]:
        probs = base.clone()
        probs[first] += moved
        probs[second] -= moved
        experts.append(probs)
    components = torch.stack([base, *experts]).log()  # (4, V)
    deltas = components[1:] - components[0]
    assert ((deltas != 0).sum(0) <= 1).all() and ((deltas != 0).sum(-1) == 2).all()  # disjoint, each non-trivial
    return components


@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0], [0.7, -0.4, 1.3]])
def test_deltas_with_disjoint_support_compose_as_the_plain_rule(weights):
    components = disjoint_experts()
    plain = compose_with_remedies(components, weights)
    for remedy in (SharedDelta(), SignConsensus()):
        torch.testing.assert_close(compose_with_remedies(components, weights, [remedy]), plain)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_identical_experts_at_weight_one_compose_to_that_expert(k):
    components = random_components(1, seed=30)
    expert = torch.log_softmax(components[1], -1)
    identical = torch.cat([components[:1], components[1:].expand(k, -1, -1)])  # base, then k copies
    torch.testing.assert_close(compose_with_remedies(identical, remedies=[SharedDelta()]), expert)
    # Without the remedy the shared change counts k times: p_b · (p_1/p_b)^k, not p_1.
    assert not torch.allclose(compose_with_remedies(identical), expert, atol=1e-2)


def test_a_token_the_plain_rule_rules_out_stays_ruled_out():
    base = log([0.4, 0.3, 0.2, 0.1])
    ruling_out = log([0.5, 0.5, 0.0, 0.0])  # tokens 2 and 3 impossible for this expert
    other = log([0.1, 0.1, 0.1, 0.7])  # which raises token 3: outvoted... but -inf still wins
    components = torch.stack([base, ruling_out, other])
    for remedy in (SharedDelta(), SignConsensus(), SignConsensus(0.5)):
        composed = compose_with_remedies(components, remedies=[remedy])
        assert torch.isneginf(composed[2:]).all() and torch.isfinite(composed[:2]).all()
        torch.testing.assert_close(composed.exp().sum(), torch.tensor(1.0))


def test_inputs_are_not_mutated_and_checked_equals_unchecked():
    components = random_components(3, seed=40).reshape(4, 2, 3, 16)
    before = components.clone()
    for remedies in (
        [SharedDelta()],
        [ActivityGate(0.5), SignConsensus(0.3), PlausibilityFilter(0.1), TerminationRule(2, source="active")],
    ):
        checked = compose_with_remedies(components, [1.0, 0.5, 2.0], remedies)
        assert torch.equal(compose_with_remedies_unchecked(components, [1.0, 0.5, 2.0], remedies), checked)
        assert torch.equal(components, before)


def test_the_candidate_set_commutes_with_the_delta_rules():
    """Filter after composing = compose each candidate's score and renormalise on the candidate set."""
    components = random_components(2, seed=50)
    allowed = PlausibilityFilter(alpha=0.05).allowed(torch.log_softmax(components, -1))  # (P, V)
    for remedy in (SharedDelta(), SignConsensus()):
        unfiltered = compose_with_remedies(components, remedies=[remedy])
        filtered = compose_with_remedies(components, remedies=[remedy, PlausibilityFilter(alpha=0.05)])
        expected = torch.log_softmax(unfiltered.masked_fill(~allowed, -math.inf), -1)
        torch.testing.assert_close(filtered, expected)


# ----------------------------------------------------------------------------- settings and bad input


def test_remedy_settings_build_and_parse():
    assert RemedySettings(shared_delta=True).build(2) == [SharedDelta()]
    assert RemedySettings(gate=0.1, sign_consensus=True, sign_consensus_density=0.5).build(2) == [
        ActivityGate(0.1),
        SignConsensus(0.5),
    ]
    assert RemedySettings.parse("sign_consensus:true;sign_consensus_density:0.3") == RemedySettings(
        sign_consensus=True, sign_consensus_density=0.3
    )
    assert RemedySettings.parse("shared_delta:true").build(2) == [SharedDelta()]


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: SignConsensus(0),
            r"`density` must be in \(0, 1\] \(the fraction of each expert's deltas kept\), got 0",
        ),
        (lambda: SignConsensus(1.5), r"`density` must be in \(0, 1\].*got 1.5"),
        (lambda: SignConsensus(math.nan), r"`density` must be in \(0, 1\].*got nan"),
        (lambda: SignConsensus(True), r"`density` must be in \(0, 1\].*got True"),
        (lambda: SignConsensus("0.5"), r"`density` must be in \(0, 1\].*got '0.5'"),
        (
            lambda: check_remedies([SharedDelta(), SignConsensus()], 8),
            r"at most one of SharedDelta and SignConsensus can be given .*got SharedDelta\(\), SignConsensus",
        ),
        (
            lambda: compose_with_remedies(torch.zeros(3, 8), remedies=[SignConsensus(), SignConsensus(0.5)]),
            "at most one of SharedDelta and SignConsensus",
        ),
        (
            lambda: check_remedies([SharedDelta], 8),
            r"unknown remedy .*allowed: ActivityGate, SharedDelta, SignConsensus",
        ),
        (lambda: RemedySettings(shared_delta=True, sign_consensus=True), "give `shared_delta` or `sign_consensus`"),
        (
            lambda: RemedySettings(gate=0.1, sign_consensus_density=0.5),
            r"`sign_consensus_density` \(0.5\) needs `sign_consensus: true`",
        ),
        (lambda: RemedySettings(sign_consensus=True, sign_consensus_density=0), "greater than 0"),
        (lambda: RemedySettings.parse("sign_consensus:maybe"), "`remedies` 'sign_consensus:maybe': sign_consensus"),
        (lambda: RemedySettings(shared_delta=False), "needs at least one of .*`shared_delta`, `sign_consensus`"),
    ],
)
def test_bad_settings_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----------------------------------------------------------------------------- generation


def naive_greedy_with_remedies(models, remedies, input_ids, attention_mask, max_new_tokens):
    """Re-run every model on the whole prefix at every step (no cache), compose with the remedies, argmax."""
    ids, mask = input_ids.clone(), attention_mask.clone()
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = torch.stack(
            [m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1] for m in models]
        )  # (k+1, B, V)
        next_tokens = torch.where(finished, torch.tensor(PAD), compose_with_remedies(logits, None, remedies).argmax(-1))
        ids = torch.cat([ids, next_tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        finished |= next_tokens == EOS
        if finished.all():
            break
    return ids


@pytest.fixture(scope="module")
def lora_experts(tiny_config, lora_dirs):
    """(the LoRA composition on a private base copy, the base and the two merged expert models)."""
    merged = [
        PeftModel.from_pretrained(random_llama(tiny_config, seed=0), str(lora_dirs[name])).merge_and_unload().eval()
        for name in ["ab", "cd"]
    ]
    return lora_dirs, [random_llama(tiny_config, seed=0), *merged]


@pytest.mark.parametrize(
    "which, remedy",
    [("full", SharedDelta()), ("full", SignConsensus(0.25)), ("lora", SharedDelta())],
    ids=["full-shared_delta", "full-sign_consensus", "lora-shared_delta"],
)
def test_cached_greedy_with_the_remedy_equals_the_naive_loop(
    which, remedy, tiny_config, base_model, expert_models, lora_experts
):
    """The KV-cached, batched loop applies the remedy at every step exactly as composing the full prefix does."""
    ids, mask = left_padded_batch([4, 9, 6], seed=7)
    if which == "full":
        models = [base_model, *expert_models]
        lm = ComposedLM(base_model, expert_models, remedies=[remedy])
    else:
        lora_dirs, models = lora_experts
        lm = ComposedLM.from_adapters(
            random_llama(tiny_config, seed=0), {name: str(path) for name, path in lora_dirs.items()}, remedies=[remedy]
        )
    generated = lm.generate(ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(generated, naive_greedy_with_remedies(models, [remedy], ids, mask, max_new_tokens=10))
    plain = ComposedLM(models[0], models[1:]).generate(ids, mask, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
    assert not torch.equal(generated, plain)  # the remedy changed what was generated
