"""Speculative decoding of the composed distribution: the rule enumerated exactly, sampled, and greedy.

* The acceptance rule (`mergecompose.composition.speculative.acceptance`) on float64 probability tables: the
  distribution of the next tokens, enumerated over every draft and every outcome, is the composed target's.
* `ComposedLM.generate(draft=...)` on tiny random models: sampled continuations fit the exactly
  enumerated composed joint (chi-square); greedy output equals plain greedy output token for token,
  for full and LoRA experts, batches with left padding, EOS, stop strings, remedies, coupled
  positions, a sliding window, and trained letters models.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from scipy import stats
from transformers import Gemma2Config, Gemma2ForCausalLM

from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.composition.remedies import (
    ActivityGate,
    PlausibilityFilter,
    SharedDelta,
    SignConsensus,
    TerminationRule,
)
from mergecompose.composition.sampling import sampling_warpers, warped_probabilities
from mergecompose.composition.speculative import decoding
from mergecompose.composition.speculative.acceptance import (
    acceptance_probabilities,
    greedy_accepted,
    outcome_probabilities,
    residual_distributions,
    round_outcomes,
    round_tokens,
)
from mergecompose.composition.speculative.decoding import attention_bias
from mergecompose.composition.speculative.draft_length import DraftLength, expected_tokens
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama
from mergecompose.core.training import train_model
from mergecompose.experiments.compare_config import ModelSettings, TrainingSettings
from mergecompose.experiments.formats import SequenceFormat
from mergecompose.experiments.models import build_model
from mergecompose.experiments.tokenizer import build_tokenizer, encode_strings
from mergecompose.merging import TaskVector, merge
from mergecompose.studies.letters.letters_task_type import letter_training_strings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- the rule, by hand


def test_outcome_table_golden():
    """p = (0.6, 0.4), q = (0.9, 0.1), x = 0: α = 0.6/0.9 = 2/3, residual (0, 1), bonus (0.5, 0.5)."""
    target = torch.tensor([[0.6, 0.4], [0.5, 0.5]], dtype=torch.float64)
    draft = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    tokens = torch.tensor([0])
    assert acceptance_probabilities(target, draft, tokens).tolist() == pytest.approx([2 / 3])
    assert residual_distributions(target[:1], draft)[0].tolist() == pytest.approx([0.0, 1.0])
    table = outcome_probabilities(target, draft, tokens)
    torch.testing.assert_close(
        table, torch.tensor([[0.0, 1 / 3], [1 / 3, 1 / 3]], dtype=torch.float64), rtol=0, atol=1e-15
    )
    # Drafting token 1 instead: p(1) ≥ q(1), always accepted; then the bonus.
    torch.testing.assert_close(
        outcome_probabilities(target, draft, torch.tensor([1])),
        torch.tensor([[0.0, 0.0], [0.5, 0.5]], dtype=torch.float64),
        rtol=0,
        atol=0,
    )
    # Where p = q nothing is rejected and the residual is p itself, not 0/0.
    assert residual_distributions(draft, draft).tolist() == [[0.9, 0.1]]


def test_greedy_acceptance_and_round_tokens_golden():
    target_tokens = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7], [4, 5, 6, 8]])
    drafts = torch.tensor([[4, 5, 6]] * 4)
    accepted = greedy_accepted(target_tokens, drafts)
    assert accepted.tolist() == [3, 1, 0, 3]
    next_tokens = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    assert round_tokens(drafts, accepted, next_tokens).tolist() == [
        [4, 5, 6, 7],
        [4, 9, 6, 9],
        [1, 5, 6, 1],
        [4, 5, 6, 8],
    ]


def test_attention_bias_golden():
    """Columns 0…5, a pad at 0 and a hole at 3; a pass over columns 4 and 5 sees the tokens up to itself."""
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    bias = attention_bias(mask, 4, torch.float32)
    low = torch.finfo(torch.float32).min
    assert bias.shape == (1, 1, 2, 6)
    assert bias[0, 0].tolist() == [[low, 0, 0, low, 0, low], [low, 0, 0, low, 0, 0]]


# ----------------------------------------------------------------------------- the rule, enumerated exactly


def emitted_distribution(target, draft, num_tokens, num_draft_tokens, outcome=outcome_probabilities):
    """P(the first `num_tokens` emitted tokens) of speculative decoding, enumerated exactly.

    `target[d]` and `draft[d]` are the conditionals after d tokens, `(V,)*d + (V,)`. Rounds draft
    min(K, tokens left − 1) tokens, as `speculative_decode` does; every prefix of d tokens is a
    state, and a round from it enumerates every draft sequence (weighted by q) and every outcome
    (n, y) of `outcome` (weighted by its table). Returns `(V,)*num_tokens`.
    """
    vocab, dtype = target[0].shape[-1], target[0].dtype
    mass = [torch.ones((), dtype=dtype)] + [torch.zeros((vocab,) * d, dtype=dtype) for d in range(1, num_tokens)]
    result = torch.zeros((vocab,) * num_tokens, dtype=dtype)
    for depth in range(num_tokens):
        count = min(num_draft_tokens, num_tokens - depth - 1)
        lead = (vocab,) * (depth + count)  # the prefix's tokens, then the drafted ones

        def at(
            tables, level, depth=depth, count=count, lead=lead
        ):  # the conditional after `level` tokens, for every (prefix, drafts)
            table = tables[level]
            return table.reshape(table.shape[:-1] + (1,) * (depth + count - level) + (vocab,)).expand(lead + (vocab,))

        grids = torch.meshgrid(*[torch.arange(vocab)] * count, indexing="ij") if count else []
        tokens = (
            torch.stack([g.reshape((1,) * depth + g.shape).expand(lead) for g in grids], -1)
            if count
            else torch.zeros(lead + (0,), dtype=torch.long)
        )  # (*lead, count)
        targets = torch.stack([at(target, depth + j) for j in range(count + 1)], -2)  # (*lead, count+1, V)
        drafts = torch.stack([at(draft, depth + j) for j in range(count)], -2) if count else targets[..., :0, :]
        path = drafts.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).prod(-1)  # (*lead,): q of the drafted tokens
        weight = mass[depth].reshape(mass[depth].shape + (1,) * count) * path
        outcomes = weight[..., None, None] * outcome(targets, drafts, tokens)  # (*lead, count+1, V)
        for accepted in range(count + 1):
            emitted = outcomes[..., accepted, :]  # prefix + first `accepted` drafts + y
            if accepted < count:
                emitted = emitted.sum(dim=tuple(range(depth + accepted, depth + count)))
            if depth + accepted + 1 == num_tokens:
                result += emitted
            else:
                mass[depth + accepted + 1] += emitted
    return result


def joint_of(tables, num_tokens):
    """Π_t p(x_t | x_<t): the joint of `num_tokens` tokens from conditionals `tables[d]`."""
    joint = tables[0]
    for depth in range(1, num_tokens):
        joint = joint.unsqueeze(-1) * tables[depth]
    return joint


def random_tables(vocab, depth, generator, scale=2.0, keep=None):
    """Conditionals `(V,)*d + (V,)` for d < depth, float64; with `keep`, only the `keep` likeliest tokens are
    possible."""
    tables = []
    for level in range(depth):
        logits = scale * torch.randn((vocab,) * level + (vocab,), generator=generator, dtype=torch.float64)
        if keep is not None:
            logits = logits.masked_fill(logits < logits.topk(keep, dim=-1).values[..., -1:], float("-inf"))
        tables.append(torch.softmax(logits, dim=-1))
    return tables


def composed_tables(components, weights):
    """The composed target in float64: p̂ ∝ p_b^(1 − Σw) Π_i p_i^(w_i), at every depth."""
    tables = []
    for level in range(len(components[0])):
        logprobs = (1 - sum(weights)) * components[0][level].log()
        for weight, expert in zip(weights, components[1:]):
            logprobs = logprobs + weight * expert[level].log()
        tables.append(torch.softmax(logprobs, dim=-1))
    return tables


@pytest.mark.parametrize("num_tokens", [3, 4])
@pytest.mark.parametrize("num_draft_tokens", [1, 2, 3, 5])
@pytest.mark.parametrize("draft_kind", ["random", "sparse", "target", "one-hot", "disjoint"])
def test_enumerated_output_is_the_composed_target(num_tokens, num_draft_tokens, draft_kind):
    """Vocabulary 4: the enumerated distribution of the next tokens equals p̂'s joint within 1e-12.

    Drafts: random; random with half the tokens impossible; the target itself (nothing rejected);
    one-hot (a greedy draft); and one that puts its mass where the target has none."""
    vocab = 4
    generator = torch.Generator().manual_seed(100 * num_tokens + num_draft_tokens)
    components = [random_tables(vocab, num_tokens, generator) for _ in range(3)]
    target = composed_tables(components, [1.0, 1.0])
    draft = {
        "random": lambda: random_tables(vocab, num_tokens, generator),
        "sparse": lambda: random_tables(vocab, num_tokens, generator, keep=2),
        "target": lambda: target,
        "one-hot": lambda: [
            torch.nn.functional.one_hot(t.argmax(-1), vocab).double()
            for t in random_tables(vocab, num_tokens, generator)
        ],
        "disjoint": lambda: [torch.softmax(-1e3 * (t > t.median(-1, keepdim=True).values), -1) for t in target],
    }[draft_kind]()
    enumerated = emitted_distribution(target, draft, num_tokens, num_draft_tokens)
    error = (enumerated - joint_of(target, num_tokens)).abs().max().item()
    assert error <= 1e-12, error


def test_enumeration_with_weights_and_a_sparse_target():
    """Weights (0.5, 1.5) and a target that rules tokens out (as top-k does) change nothing."""
    generator = torch.Generator().manual_seed(7)
    components = [random_tables(5, 3, generator, keep=3) for _ in range(3)]
    components[0] = random_tables(5, 3, generator)  # the base, raised to a negative power, must be positive
    target = composed_tables(components, [0.5, 1.5])
    assert (target[0] == 0).any()
    enumerated = emitted_distribution(target, random_tables(5, 3, generator), 3, 2)
    assert (enumerated - joint_of(target, 3)).abs().max().item() <= 1e-12


def test_enumeration_detects_a_wrong_rule():
    """The enumeration can fail: accepting every draft gives the draft's joint; drawing y from p
    instead of the residual double-counts the accepted mass."""
    generator = torch.Generator().manual_seed(3)
    target, draft = random_tables(4, 3, generator), random_tables(4, 3, generator)
    joint = joint_of(target, 3)

    def accept_all(p, q, tokens):
        count = tokens.shape[-1]
        return round_outcomes(
            torch.ones_like(tokens, dtype=p.dtype), residual_distributions(p[..., :count, :], q), p[..., count, :]
        )

    def residual_is_target(p, q, tokens):
        count = tokens.shape[-1]
        return round_outcomes(acceptance_probabilities(p, q, tokens), p[..., :count, :], p[..., count, :])

    for wrong in (accept_all, residual_is_target):
        assert (emitted_distribution(target, draft, 3, 2, wrong) - joint).abs().max().item() > 1e-2


# ----------------------------------------------------------------------------- models


def perturbed(model, seed, scale):
    """A copy of `model` with Gaussian noise on every matrix, `scale` times that matrix's own std."""
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copied.parameters():
            if parameter.dim() > 1:
                parameter.add_(scale * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return copied.eval()


@pytest.fixture(scope="module")
def noisy_composition(base_model):
    """Experts = the base + noise at 0.3 of each matrix's std: their merge is a poor draft (sampling at
    temperature 1.2 accepts 62 % of drafts; greedy argmaxes agree on about 20 %)."""
    return ComposedLM(base_model, [perturbed(base_model, 1, 0.3), perturbed(base_model, 2, 0.3)])


@pytest.fixture(scope="module")
def unrelated_composition(base_model, expert_models):
    """Three independent random models: their merge θ_1 + θ_2 − θ_b is no draft at all (a ≈ 0)."""
    return ComposedLM(base_model, expert_models)


def alternative_outcomes(target, draft, tokens):
    """The rule with a 1 % error: every acceptance probability 0.99 α."""
    count = tokens.shape[-1]
    return round_outcomes(
        0.99 * acceptance_probabilities(target, draft, tokens),
        residual_distributions(target[..., :count, :], draft),
        target[..., count, :],
    )


def conditionals(logprobs, warpers, prompt_length, vocab):
    """Warped probabilities after 0, 1 and 2 tokens, from teacher-forced log-probs of every prompt + (x1, x2)."""
    probabilities = warped_probabilities(warpers, logprobs).double().view(vocab, vocab, -1, vocab)  # (x1, x2, T, V)
    probabilities = probabilities / probabilities.sum(-1, keepdim=True)  # sums of exactly 1 in float64
    return [
        probabilities[0, 0, prompt_length - 1],
        probabilities[:, 0, prompt_length],
        probabilities[:, :, prompt_length + 1],
    ]


def chi_square(counts, expected):
    """Pearson's test of `counts` against probabilities `expected`; cells expecting fewer than 5 pooled into one."""
    keep = expected * counts.sum() >= 5
    observed, wanted = counts[keep].double(), expected[keep]
    if not keep.all():
        observed = torch.cat([observed, counts[~keep].sum()[None].double()])
        wanted = torch.cat([wanted, expected[~keep].sum()[None]])
    wanted = wanted / wanted.sum() * observed.sum()  # float64 rounding: totals must agree exactly
    return stats.chisquare(observed.numpy(), wanted.numpy())


def test_sampled_continuations_fit_the_composed_joint(noisy_composition):
    """200,000 sampled 3-token continuations (K = 2, temperature 1.2, top-p 0.95) fit p̂'s exact joint.

    The joint of the 64³ continuations is enumerated from teacher-forced composed log-probs,
    warped as `generate` warps them. Two chi-square tests: on every cell (cells expecting fewer
    than 5 pooled), and on the 8 cells that say, for each of the 3 tokens, whether it is one whose
    probability a wrong acceptance rule lowers or raises.

    Power calculation (the sample size). A 1 % error in the acceptance rule, α' = 0.99 α, moves
    1 % of the accepted mass to the residuals. Enumerating that rule exactly
    (`alternative_outcomes`) gives, on the 8 cells, a non-centrality of 1.29e-4 per sample
    (total variation 0.52 %), so at N = 200,000 a chi-square test at level 0.01 (7 degrees of
    freedom) detects it with power 0.92 (scipy's `ncx2`; recomputed below from these models and
    asserted ≥ 0.85). The test on every cell spreads the same error over ~8,200 cells and has
    power 0.01 against it: it guards against gross errors only. Run once with α' = 0.99 α put
    into `speculative_decode`, the 8-cell test gave p = 0.001; with the residual replaced by p̂,
    both gave p < 0.001. Measured: acceptance rate 0.62, p-values 0.056 (8 cells), 0.146 (all).
    """
    lm, vocab, samples, batch = noisy_composition, 64, 200_000, 50_000
    warpers = sampling_warpers(True, 1.2, None, 0.95)
    prompt = torch.tensor([[5, 17, 33, 9]])
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (4096, 2): x1-major
    inputs = torch.cat([prompt.expand(len(pairs), -1), pairs], dim=1)  # (4096, 6)
    target = conditionals(lm.logprobs(inputs), warpers, prompt.shape[1], vocab)
    draft_logprobs = torch.log_softmax(lm.merged_draft()(inputs).logits.float(), dim=-1)
    draft = conditionals(draft_logprobs, warpers, prompt.shape[1], vocab)
    joint = joint_of(target, 3)  # (V, V, V)
    assert (emitted_distribution(target, draft, 3, 2) - joint).abs().max().item() < 1e-12  # the rule, on these tables

    # The 8 cells: per token, does α' = 0.99 α lower its probability (given its prefix)?
    lowered = []
    for p, q in zip(target, draft):
        overlap = torch.minimum(p, q)
        residual = (p - q).clamp(min=0)
        residual = residual / residual.sum(-1, keepdim=True)
        lowered.append(overlap > overlap.sum(-1, keepdim=True) * residual)
    cells = (
        4 * lowered[0].long().view(vocab, 1, 1) + 2 * lowered[1].long().view(vocab, vocab, 1) + lowered[2].long()
    ).flatten()
    expected = torch.zeros(8, dtype=torch.float64).index_add_(0, cells, joint.flatten())
    alternative = torch.zeros(8, dtype=torch.float64).index_add_(
        0, cells, emitted_distribution(target, draft, 3, 2, alternative_outcomes).flatten()
    )
    noncentrality = samples * ((alternative - expected) ** 2 / expected).sum().item()
    power = stats.ncx2.sf(stats.chi2.ppf(0.99, 7), 7, noncentrality)
    assert power >= 0.85, power

    drawn = []
    acceptance = []
    for seed in range(samples // batch):
        out = lm.generate(
            prompt.expand(batch, -1),
            max_new_tokens=3,
            do_sample=True,
            temperature=1.2,
            top_p=0.95,
            eos_token_id=[],
            seed=seed,
            draft="merged",
            num_draft_tokens=2,
        )
        drawn.append(out[:, prompt.shape[1] :])
        acceptance.append(lm.speculation_stats.acceptance_rate)
    drawn = torch.cat(drawn)  # (N, 3)
    flat = (drawn[:, 0] * vocab + drawn[:, 1]) * vocab + drawn[:, 2]
    counts = torch.bincount(flat, minlength=vocab**3)
    coarse = chi_square(torch.bincount(cells[flat], minlength=8), expected)
    full = chi_square(counts, joint.flatten())
    print(
        f"acceptance {sum(acceptance) / len(acceptance):.3f}; chi-square p-values: 8 cells {coarse.pvalue:.3f} "
        f"(power {power:.2f} against α' = 0.99 α), all cells {full.pvalue:.3f}"
    )
    assert 0.3 < min(acceptance) and max(acceptance) < 0.8  # rejections are frequent, and so are acceptances
    assert coarse.pvalue > 0.01 and full.pvalue > 0.01


# ----------------------------------------------------------------------------- greedy: token for token


def greedy_pair(lm, ids, mask=None, draft="merged", num_draft_tokens=None, **kwargs):
    """(plain greedy output, speculative greedy output) of the same call."""
    plain = lm.generate(ids, mask, **kwargs)
    return plain, lm.generate(ids, mask, draft=draft, num_draft_tokens=num_draft_tokens, **kwargs)


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 8])
@pytest.mark.parametrize("which", ["noisy", "unrelated"])
def test_greedy_speculation_equals_greedy_decoding(which, num_draft_tokens, noisy_composition, unrelated_composition):
    """A left-padded batch with EOS: rows finish at different rounds and accept different numbers of drafts."""
    lm = {"noisy": noisy_composition, "unrelated": unrelated_composition}[which]
    ids, mask = left_padded_batch([5, 9, 2, 7], seed=num_draft_tokens)
    plain = lm.generate(ids, mask, max_new_tokens=24, eos_token_id=[EOS, 11], pad_token_id=PAD)
    fast = lm.generate(
        ids,
        mask,
        max_new_tokens=24,
        eos_token_id=[EOS, 11],
        pad_token_id=PAD,
        draft="merged",
        num_draft_tokens=num_draft_tokens,
    )
    assert torch.equal(plain, fast)
    statistics = lm.speculation_stats
    assert statistics.num_draft_tokens == num_draft_tokens and statistics.rounds >= 1
    generated = plain[:, ids.shape[1] :]
    ends = torch.isin(generated, torch.tensor([EOS, 11]))
    lengths = torch.where(ends.any(1), ends.long().argmax(1) + 1, generated.shape[1])  # up to and including EOS
    assert statistics.emitted == int(lengths.sum())
    assert 0 < statistics.accepted < statistics.tested if which == "noisy" else statistics.acceptance_rate < 0.1


def test_a_draft_equal_to_the_target_is_always_accepted(base_model, expert_models):
    """One expert at weight 1 composes to that expert; as its own draft every token is accepted."""
    lm = ComposedLM(base_model, expert_models[:1])
    ids = torch.tensor([[7, 8, 9]])
    plain, fast = greedy_pair(
        lm, ids, max_new_tokens=13, eos_token_id=[], draft=expert_models[0], num_draft_tokens=4, adaptive_draft=False
    )
    assert torch.equal(plain, fast)
    statistics = lm.speculation_stats
    # K fixed (adaptive_draft=False): rounds of 5, 5 and 3 tokens, 4 + 4 + 2 drafts
    # (a round drafts at most the tokens left − 1).
    assert (statistics.acceptance_rate, statistics.rounds, statistics.draft_passes) == (1.0, 3, 10)
    assert statistics.tokens_per_round == 13 / 3
    lm.generate(ids, max_new_tokens=13, eos_token_id=[], do_sample=True, seed=0, draft="merged", num_draft_tokens=4)
    assert lm.speculation_stats.acceptance_rate > 0.97  # θ_b + (θ_1 − θ_b) = θ_1 up to float rounding


@pytest.mark.parametrize("implementation", ["stacked", "peft"])
def test_greedy_speculation_with_lora_experts_rolls_back_the_shared_cache(implementation, tiny_config, lora_dirs):
    """LoRA experts on one base (one cache of (k+1)·B rows): equal outputs, and a warning that a draft can only lose."""
    lm = ComposedLM.from_adapters(
        random_llama(tiny_config, seed=0), {k: str(v) for k, v in lora_dirs.items()}, lora_implementation=implementation
    )
    ids, mask = left_padded_batch([6, 3, 8], seed=2)
    plain = lm.generate(ids, mask, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.warns(UserWarning, match="share one base.*can only lose"):
        fast = lm.generate(
            ids,
            mask,
            max_new_tokens=20,
            eos_token_id=EOS,
            pad_token_id=PAD,
            draft="merged",
            num_draft_tokens=3,
            adaptive_draft=False,  # every round drafts: the roll-back happens in each
        )
    assert torch.equal(plain, fast)
    assert 0 < lm.speculation_stats.accepted < lm.speculation_stats.tested  # both outcomes happened


@pytest.mark.parametrize("delta_rule", [[], [SharedDelta()], [SignConsensus(0.25)]], ids=["plain", "shared", "sign"])
def test_greedy_speculation_with_remedies(base_model, delta_rule):
    """Gate, delta rule, plausibility filter and termination rule apply to the target at every verified position."""
    experts = [perturbed(base_model, 3, 0.5), perturbed(base_model, 4, 0.5), perturbed(base_model, 5, 0.5)]
    remedies = [
        ActivityGate(1.0),
        *delta_rule,
        PlausibilityFilter(alpha=0.05),
        TerminationRule(EOS, source="active", threshold=1.0),
    ]
    lm = ComposedLM(base_model, experts, remedies=remedies)
    ids, mask = left_padded_batch([4, 6, 6], seed=9)
    plain, fast = greedy_pair(lm, ids, mask, max_new_tokens=20, eos_token_id=EOS, pad_token_id=PAD, num_draft_tokens=3)
    assert torch.equal(plain, fast)
    assert not torch.equal(
        plain, ComposedLM(base_model, experts).generate(ids, mask, max_new_tokens=20, eos_token_id=EOS)
    )


def test_greedy_speculation_with_given_positions(noisy_composition):
    """`position_ids` and `generated_position_ids` as in plain `generate`: every token at twice its index."""
    ids, mask = left_padded_batch([4, 7], seed=11)
    prompt_positions = 2 * (mask.cumsum(-1) - 1).clamp(min=0)
    generated_positions = prompt_positions[:, -1:] + 2 * torch.arange(1, 13)
    plain, fast = greedy_pair(
        noisy_composition,
        ids,
        mask,
        max_new_tokens=12,
        eos_token_id=[],
        position_ids=prompt_positions,
        generated_position_ids=generated_positions,
        num_draft_tokens=3,
    )
    assert torch.equal(plain, fast)
    assert not torch.equal(
        fast, noisy_composition.generate(ids, mask, max_new_tokens=12, eos_token_id=[], draft="merged")
    )


def test_greedy_speculation_with_stop_strings(noisy_composition):
    """Stop strings end each row where they end it in plain decoding, also in the middle of a round."""
    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567")
    ids, mask = left_padded_batch([3, 5, 4], seed=12)
    free = noisy_composition.generate(ids, mask, max_new_tokens=16, eos_token_id=[])
    tokens = [tokenizer.convert_ids_to_tokens(row) for row in free[:, ids.shape[1] :].tolist()]
    stop = ["".join(tokens[0][5:7]), "".join(tokens[1][2:4])]
    plain, fast = greedy_pair(
        noisy_composition,
        ids,
        mask,
        max_new_tokens=16,
        eos_token_id=[],
        stop_strings=stop,
        tokenizer=tokenizer,
        num_draft_tokens=4,
    )
    assert torch.equal(plain, fast)
    assert plain.shape[1] < free.shape[1] or (plain[:, ids.shape[1] :] != free[:, ids.shape[1] :]).any()


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_speculation_past_a_sliding_window(rows):
    """Gemma-2 with a 4-token window and soft-capping: caches cut back past the window; with several rows
    (whose masked holes would count against the window) every row advances alike."""
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        attn_implementation="eager",
        pad_token_id=0,
        eos_token_id=2,
    )
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(Gemma2ForCausalLM(config).eval())
    lm = ComposedLM(models[0], [perturbed(models[0], 1, 0.1), perturbed(models[0], 2, 0.1)])
    ids, mask = left_padded_batch([6, 3, 5][:rows], seed=13)
    plain, fast = greedy_pair(lm, ids, mask, max_new_tokens=20, eos_token_id=[], num_draft_tokens=3)
    assert torch.equal(plain, fast)
    assert lm.speculation_stats.accepted > 0


# ----------------------------------------------------------------------------- trained letters models


@pytest.fixture(scope="module")
def letters():
    """A base trained to copy (coupled positions), and experts A → B and C → D fine-tuned from it."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    tokenizer = build_tokenizer(alphabet)
    fmt = SequenceFormat(
        "seq2seq", "coupled", True, 48, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.sep_token_id
    )
    base = build_model(
        ModelSettings(hidden_size=32, max_position_embeddings=48),
        len(tokenizer),
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        seed=0,
    )
    settings = TrainingSettings(steps=150, batch_size=32, lr=5e-3)
    train_model(
        base,
        letter_training_strings(alphabet, (1, 8), {}, tokenizer, fmt, settings, seed=0),
        settings,
        settings.total_steps,
        progress=False,
    )
    experts = []
    for seed, replace in enumerate([{"A": "B"}, {"C": "D"}], start=1):
        expert = copy.deepcopy(base)
        settings = TrainingSettings(steps=60, batch_size=32, lr=3e-3)
        train_model(
            expert,
            letter_training_strings(alphabet, (1, 8), replace, tokenizer, fmt, settings, seed=seed),
            settings,
            settings.total_steps,
            progress=False,
        )
        experts.append(expert.eval())
    return ComposedLM(base.eval(), experts, tokenizers=tokenizer), fmt, tokenizer


@pytest.mark.parametrize("draft_lambda", [None, [0.5, 0.5]])
def test_greedy_speculation_on_trained_letters_models(letters, draft_lambda):
    """Coupled positions: the letters' composition, and the merge as a draft that is nearly always right."""
    lm, fmt, tokenizer = letters
    texts = ["CAB", "ACDC", "HELLO", "BANANA C", "XACAX", "QQ"]
    prompt = fmt.prompt(encode_strings(tokenizer, texts), 9)
    kwargs = dict(
        max_new_tokens=9,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        position_ids=prompt.position_ids,
        generated_position_ids=prompt.generated_position_ids,
    )
    plain = lm.generate(prompt.input_ids, prompt.attention_mask, **kwargs)
    fast = lm.generate(prompt.input_ids, prompt.attention_mask, draft="merged", draft_lambda=draft_lambda, **kwargs)
    assert torch.equal(plain, fast)
    outputs = tokenizer.batch_decode(plain[:, prompt.input_ids.shape[1] :], skip_special_tokens=True)
    assert [text.replace(" ", "") for text in outputs[:2]] == ["DBB", "BDDD"]  # both skills at once
    assert lm.speculation_stats.acceptance_rate > 0.8


# ----------------------------------------------------------------------------- the merged draft


def test_merged_draft_is_task_arithmetic(base_model, expert_models):
    """The merged draft is `mergecompose.merging.merge("task_arithmetic", weights=λ, lam=1)`'s
    θ_b + Σ_i λ_i (θ_i − θ_b), exactly (the draft calls it tensor by tensor); the base untouched."""
    before = {name: tensor.clone() for name, tensor in base_model.state_dict().items()}
    lm = ComposedLM(base_model, expert_models, weights=[0.7, 1.3])
    draft = lm.merged_draft()
    expected = merge("task_arithmetic", base_model, expert_models, weights=[0.7, 1.3], lam=1.0, progress=False)
    got = draft.state_dict()
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
    assert lm.merged_draft() is draft and lm.merged_draft([0.7, 1.3]) is draft  # built once per λ
    other = lm.merged_draft([0.5, 0.5])
    torch.testing.assert_close(
        other.state_dict()["lm_head.weight"],
        merge("task_arithmetic", base_model, expert_models, weights=[0.5, 0.5], lam=1.0, progress=False)[
            "lm_head.weight"
        ],
        rtol=0,
        atol=0,
    )
    for name, tensor in base_model.state_dict().items():
        assert torch.equal(tensor, before[name])
    reference = copy.deepcopy(base_model)
    reference.load_state_dict(expected)
    ids = torch.tensor([[4, 5, 6]])
    torch.testing.assert_close(draft(ids).logits, reference(ids).logits, rtol=0, atol=0)  # buffers (RoPE) included


@pytest.mark.parametrize("implementation", ["stacked", "peft"])
def test_merged_lora_draft_is_task_arithmetic(implementation, tiny_config, lora_dirs):
    """W + Σ_i λ_i ΔW_i with peft's deltas, equal to `mergecompose.merging.merge` of `TaskVector.from_lora`; shared
    tensors stay shared."""
    base = random_llama(tiny_config, seed=0)
    reference = random_llama(tiny_config, seed=0)
    lm = ComposedLM.from_adapters(
        base, {k: str(v) for k, v in lora_dirs.items()}, weights=[0.6, 1.4], lora_implementation=implementation
    )
    draft = lm.merged_draft()
    vectors = [TaskVector.from_lora(reference, str(lora_dirs[name])) for name in ["ab", "cd"]]
    expected = merge("task_arithmetic", reference, vectors, weights=[0.6, 1.4], lam=1.0, progress=False)
    got = draft.state_dict()
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)
    assert draft.model.embed_tokens.weight.data_ptr() == lm.base_model.model.embed_tokens.weight.data_ptr()
    lm.close()
    for name, tensor in base.state_dict().items():  # the caller's base, given back, is as it was
        assert torch.equal(tensor, reference.state_dict()[name])


# ------------------------------------------------------------------------- the adaptive K (speculative/draft_length.py)
# The policy on given timings, and exactness under any K schedule: whatever K each round drafts (0 being
# a plain step), greedy output equals plain greedy output token for token and sampled continuations fit
# the composed joint. The schedules are forced, so that every kind of switch happens (a plain step
# first, drafting after plain steps, K rising and falling).


def test_expected_tokens_golden():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def play(policy: DraftLength, acceptance: float, draft_pass: float, verify: float, rounds: int) -> list[int]:
    """Run `policy` against a machine where a draft pass costs `draft_pass`, a target pass `verify` + 0.01·K, and
    every draft is accepted with rate `acceptance` exactly in expectation (accepted = a · tested)."""
    chosen = []
    for _ in range(rounds):
        k = policy.next()
        chosen.append(k)
        tested = k  # every draft tested: the expected counts
        policy.update(k, acceptance * tested, tested, k * draft_pass + verify + 0.01 * k)
    return chosen


def test_a_poor_draft_falls_back_to_plain_steps_and_probes_now_and_then():
    chosen = play(DraftLength(4, draft_cost=0.4), acceptance=0.05, draft_pass=0.4, verify=1.0, rounds=60)
    assert chosen[:2] == [1, 0]  # one draft (that round also fills the caches), then a timed plain step
    later = chosen[2:]
    assert later.count(0) >= 55 and sum(k > 0 for k in later) <= 2  # plain steps; probes after 8, 64, 128... rounds
    probed = play(DraftLength(4, draft_cost=0.4), acceptance=0.05, draft_pass=0.4, verify=1.0, rounds=300)
    assert 2 <= sum(k > 0 for k in probed[2:]) <= 5


def test_a_good_draft_keeps_drafting_and_a_cheap_one_drafts_the_most():
    assert set(play(DraftLength(4, draft_cost=0.1), acceptance=0.95, draft_pass=0.1, verify=1.0, rounds=30)[3:]) == {4}
    middle = play(DraftLength(4, draft_cost=0.3), acceptance=0.6, draft_pass=0.3, verify=1.0, rounds=30)[3:]
    assert 0 not in middle and max(middle) < 4  # drafting pays, but not four tokens a round


def test_a_good_draft_whose_first_token_is_rejected_drafts_again_soon():
    # The first round's one draft is rejected (a falls from the prior 0.5 to 0.31: plain steps); every later
    # draft is accepted at 0.95. The first probe comes after 8 plain rounds, and drafting comes back for good.
    policy = DraftLength(4, draft_cost=1 / 3)
    chosen = []
    for round_ in range(64):
        k = policy.next()
        chosen.append(k)
        accepted = 0.0 if round_ == 0 else 0.95 * k
        policy.update(k, accepted, k, k * 1 / 3 + 1.0 + 0.01 * k)
    assert chosen[:3] == [1, 0, 0]  # the rejection sends it to plain steps
    assert 0 < chosen.index(1, 2) <= 12  # the first probe
    assert chosen[16:].count(0) == 0 and max(chosen[16:]) == 4  # drafting again, four tokens a round


def test_a_fixed_k_ignores_what_it_sees():
    assert set(play(DraftLength(3, adaptive=False), acceptance=0.0, draft_pass=1.0, verify=1.0, rounds=10)) == {3}


def test_an_untimed_round_does_not_move_the_times():
    policy = DraftLength(2)
    for _ in range(3):
        policy.next()
    policy.update(2, 1, 2, None)
    assert policy.plain_seconds is None and policy.draft_pass_seconds is None


class Schedule:
    """A DraftLength that drafts K from a fixed cycle, for the exactness tests."""

    cycle: tuple[int, ...] = ()

    def __init__(self, max_draft_tokens: int, adaptive: bool = True, **costs) -> None:
        self.ks = itertools.cycle(self.cycle)
        self.max_draft_tokens = max_draft_tokens

    def next(self) -> int:
        return min(next(self.ks), self.max_draft_tokens)

    def update(self, *args) -> None:
        pass


@pytest.mark.parametrize("cycle", [(0, 3, 1, 0, 0, 2), (0,), (2, 0)])
@pytest.mark.parametrize("which", ["noisy", "unrelated"])
def test_greedy_output_under_any_k_schedule_equals_plain_decoding(
    which, cycle, noisy_composition, unrelated_composition, monkeypatch
):
    monkeypatch.setattr(decoding, "DraftLength", type("Forced", (Schedule,), {"cycle": cycle}))
    lm = {"noisy": noisy_composition, "unrelated": unrelated_composition}[which]
    ids, mask = left_padded_batch([5, 9, 2, 7], seed=3)
    options = dict(max_new_tokens=24, eos_token_id=[EOS, 11], pad_token_id=PAD)
    plain = lm.generate(ids, mask, **options)
    fast = lm.generate(ids, mask, draft="merged", num_draft_tokens=3, **options)
    assert torch.equal(plain, fast)
    assert lm.speculation_stats.plain_rounds > 0
    assert (lm.speculation_stats.drafted > 0) == (cycle != (0,))


def test_sampled_continuations_under_a_k_schedule_fit_the_composed_joint(noisy_composition, monkeypatch):
    """As `test_sampled_continuations_fit_the_composed_joint` (test_speculative.py), rounds of K = 0, 1, 0, 1…:
    a plain step first, then a draft that catches up on a token it has not seen."""
    monkeypatch.setattr(decoding, "DraftLength", type("Forced", (Schedule,), {"cycle": (0, 1)}))
    lm, vocab, samples, batch = noisy_composition, 64, 100_000, 50_000
    warpers = sampling_warpers(True, 1.2, None, 0.95)
    prompt = torch.tensor([[5, 17, 33, 9]])
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    inputs = torch.cat([prompt.expand(len(pairs), -1), pairs], dim=1)
    joint = joint_of(conditionals(lm.logprobs(inputs), warpers, prompt.shape[1], vocab), 3)  # (V, V, V)
    drawn = []
    for seed in range(samples // batch):
        out = lm.generate(
            prompt.expand(batch, -1),
            max_new_tokens=3,
            do_sample=True,
            temperature=1.2,
            top_p=0.95,
            eos_token_id=[],
            seed=seed,
            draft="merged",
            num_draft_tokens=2,
        )
        drawn.append(out[:, prompt.shape[1] :])
        assert lm.speculation_stats.plain_rounds > 0 and lm.speculation_stats.tested > 0
    drawn = torch.cat(drawn)
    flat = (drawn[:, 0] * vocab + drawn[:, 1]) * vocab + drawn[:, 2]
    first_two = torch.bincount(drawn[:, 0] * vocab + drawn[:, 1], minlength=vocab**2)
    assert chi_square(first_two, joint.sum(-1).flatten()).pvalue > 0.01
    assert chi_square(torch.bincount(flat, minlength=vocab**3), joint.flatten()).pvalue > 0.01
