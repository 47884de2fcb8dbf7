"""Failure analysis of composed generation: termination, first-error location, background noise."""

from __future__ import annotations

import math

import pytest
import torch

from mergecompose.analysis.failures import (
    EOS_EARLY,
    EOS_LATE,
    EOS_MISSING,
    EOS_ON_TIME,
    EXACT,
    background_noise,
    eos_outcomes,
    failure_summary,
    first_error_regions,
    first_errors,
    mean_by_region,
    owner_weights,
    spurious_activity_rate,
)
from mergecompose.composition import compose_logprobs
from mergecompose.studies.skills.analysis import activity_examples
from mergecompose.studies.skills.spec import BACKGROUND, BOUNDARY, END, SEGMENT

PAD, EOS = 0, 2

# Every row's target is the 3 tokens 5 6 7 then EOS; its regions: background, segment, boundary, end.
TARGETS = torch.tensor([[5, 6, 7, EOS, PAD]] * 5)
LENGTHS = torch.tensor([3] * 5)
REGIONS = torch.tensor([[BACKGROUND, SEGMENT, BOUNDARY, END, END]] * 5)
GENERATED = torch.tensor(
    [
        [5, 6, 7, EOS, PAD, PAD],  # exact
        [5, EOS, PAD, PAD, PAD, PAD],  # stops early inside the segment
        [5, 6, 7, 7, 7, 7],  # every character right, never stops
        [5, 6, 7, 8, EOS, PAD],  # one character too many, then stops
        [5, 9, 7, EOS, PAD, PAD],  # a wrong character, stops on time
    ]
)


def test_eos_outcomes_golden():
    outcomes = eos_outcomes(GENERATED, LENGTHS, EOS)
    assert outcomes.tolist() == [EOS_ON_TIME, EOS_EARLY, EOS_MISSING, EOS_LATE, EOS_ON_TIME]


def test_first_errors_and_their_regions_golden():
    first = first_errors(GENERATED, TARGETS, LENGTHS, PAD)
    assert first.tolist() == [EXACT, 1, 3, 3, 1]
    assert first_error_regions(first, REGIONS).tolist() == [EXACT, SEGMENT, END, END, SEGMENT]


def test_a_row_cut_before_its_eos_is_wrong_where_it_stops():
    generated = torch.tensor([[5, 6], [5, 9]])
    first = first_errors(generated, TARGETS[:2], LENGTHS[:2], PAD)
    assert first.tolist() == [2, 1]
    assert eos_outcomes(generated, LENGTHS[:2], EOS).tolist() == [EOS_MISSING, EOS_MISSING]


def test_a_pad_target_past_the_eos_is_not_compared():
    # Target of length 1 (token 5, EOS); whatever follows the EOS does not matter.
    targets = torch.tensor([[5, EOS, PAD, PAD]])
    assert first_errors(torch.tensor([[5, EOS, 9, 9]]), targets, torch.tensor([1]), PAD).tolist() == [EXACT]


def test_failure_summary_golden():
    summary = failure_summary(GENERATED, TARGETS, LENGTHS, REGIONS, EOS, PAD)
    assert summary["n"] == 5
    assert summary["exact_match"] == pytest.approx(0.2)
    assert summary["eos"] == pytest.approx({"on_time": 0.4, "early": 0.2, "late": 0.2, "missing": 0.2})
    assert summary["early_or_missing_eos"] == pytest.approx(0.4)
    assert summary["first_error"] == pytest.approx({"background": 0.0, "segment": 0.4, "boundary": 0.0, "end": 0.4})
    assert summary["exact_match"] + sum(summary["first_error"].values()) == pytest.approx(1.0)
    assert summary["first_error_is_eos"] == pytest.approx(0.2)  # only row 1 stopped as its first error


def test_failure_functions_reject_bad_shapes():
    with pytest.raises(ValueError, match="`target_lengths` must hold 5 rows"):
        eos_outcomes(GENERATED, torch.tensor([3, 3]), EOS)
    with pytest.raises(ValueError, match="must hold each target and its EOS"):
        first_errors(GENERATED, TARGETS[:, :3], LENGTHS, PAD)
    with pytest.raises(ValueError, match="`generated` must have 2 dimensions"):
        first_errors(GENERATED[0], TARGETS, LENGTHS, PAD)


# ------------------------------------------------------------------------------ background noise


def _log(probabilities):
    return torch.tensor(probabilities).log()


def test_background_noise_golden():
    # V = 4, EOS = 2, one step, k = 2. The base is uniform; expert 0 equals it; expert 1 does not.
    uniform = [0.25, 0.25, 0.25, 0.25]
    eos_heavy = [1 / 6, 1 / 6, 1 / 2, 1 / 6]
    components = torch.stack([_log(uniform), _log(uniform), _log(eos_heavy)]).view(3, 1, 1, 4)
    noise = background_noise(components, torch.tensor([[-1]]), EOS)  # a background step: nobody owns it
    assert noise["eos_noise"].item() == pytest.approx(math.log(2))
    assert noise["inactive_activity"].item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-5)
    # The oracle is the base (uniform); the plain composition is expert 1's distribution.
    expected_shift = 0.75 * math.log(0.25 / (1 / 6)) + 0.25 * math.log(0.25 / 0.5)
    assert noise["oracle_shift"].item() == pytest.approx(expected_shift, rel=1e-5)
    # The oracle's argmax is token 0 (uniform: the first maximum), the composition's is EOS.
    assert noise["oracle_flip"].item() == 1.0
    # Owned by expert 1, the same step has no silent deviation at all.
    owned = background_noise(components, torch.tensor([[1]]), EOS)
    assert owned["eos_noise"].item() == 0.0 and owned["inactive_activity"].item() == 0.0
    assert owned["oracle_shift"].item() == pytest.approx(0.0, abs=1e-6)


def test_no_noise_when_non_owners_equal_the_base():
    # Joint factorizability: each expert differs from the base only on the steps it owns.
    generator = torch.Generator().manual_seed(0)
    k, batch, steps, vocab = 3, 2, 6, 7
    base = torch.log_softmax(torch.randn(batch, steps, vocab, generator=generator), -1)
    owners = torch.tensor([[-1, 0, 0, 1, -1, 2], [2, 2, -1, 1, 0, -1]])
    experts = []
    for index in range(k):
        own = torch.log_softmax(torch.randn(batch, steps, vocab, generator=generator), -1)
        experts.append(torch.where((owners == index)[..., None], own, base))
    noise = background_noise(torch.stack([base, *experts]), owners, EOS)
    assert noise["inactive_activity"].abs().max() < 1e-6
    assert noise["eos_noise"].abs().max() < 1e-6
    assert noise["oracle_shift"].abs().max() < 1e-5
    assert noise["oracle_flip"].sum() == 0
    # ...while the activity of each owner is positive exactly where it owns a step.
    assert ((noise["activity"] > 1e-4) == owner_weights(owners, k).bool()).all()


def test_eos_noise_grows_linearly_with_the_number_of_silent_experts():
    # Each silent expert adds the same small EOS bump; the plain composition's EOS log-odds add up.
    base = torch.log_softmax(torch.zeros(1, 1, 5), -1)
    bump = torch.zeros(1, 1, 5)
    bump[..., EOS] = 0.3
    expert = torch.log_softmax(bump, -1)
    delta = (expert - base)[0, 0, EOS].item()
    for k in [1, 2, 4, 6]:
        components = torch.stack([base] + [expert] * k)
        noise = background_noise(components, torch.tensor([[-1]]), EOS)
        assert noise["eos_noise"].item() == pytest.approx(k * delta, rel=1e-5)
        composed = compose_logprobs(base, [expert] * k)
        # The composed EOS log-odds against any other token rise by k · 0.3.
        assert (composed[0, 0, EOS] - composed[0, 0, 0]).item() == pytest.approx(0.3 * k, rel=1e-5)


def test_owner_weights_and_errors():
    assert owner_weights(torch.tensor([[-1, 0, 1]]), 2).tolist() == [[[0, 1, 0]], [[0, 0, 1]]]
    with pytest.raises(ValueError, match=r"expert indices in \[0, 2\) or -1"):
        owner_weights(torch.tensor([[2]]), 2)
    with pytest.raises(ValueError, match="`owners` must be \\(batch, steps\\)"):
        background_noise(torch.zeros(3, 1, 2, 4), torch.tensor([[0]]), EOS)


def test_mean_by_region_golden():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    regions = torch.tensor([[BACKGROUND, SEGMENT, SEGMENT, END], [BACKGROUND, BOUNDARY, SEGMENT, END]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1]])
    assert mean_by_region(values, regions, mask) == {"background": 3.0, "segment": 2.5, "boundary": 6.0, "end": 6.0}
    assert mean_by_region(values[:1], regions[:1])["boundary"] is None


def test_spurious_activity_rate_golden():
    activity = torch.tensor([[[0.5, 0.0, 0.2]], [[0.0, 0.3, 0.0]]])  # (k=2, B=1, T=3)
    owners = torch.tensor([[0, -1, -1]])
    # Silent pairs: expert 0 at steps 1, 2 and expert 1 at steps 0, 1, 2; active among them: (0, 2), (1, 1).
    assert spurious_activity_rate(activity, owners, epsilon=0.1) == pytest.approx(2 / 5)
    assert spurious_activity_rate(activity, owners, epsilon=0.25) == pytest.approx(1 / 5)


def test_activity_examples_golden():
    # 2 sequences of 4 characters + EOS; expert 0 owns steps 1-2 of sequence 0, expert 1 owns none there.
    owners = torch.tensor([[-1, 0, 0, -1, -1], [1, 1, -1, 0, -1]])
    activity = torch.arange(20, dtype=torch.float32).view(2, 2, 5)  # (k, B, L+1)
    rows = activity_examples(activity, owners, ["a[b]", "<c>d"], examples=5)
    assert [row["sequence"] for row in rows] == [0, 1]
    assert rows[0]["intervals"] == [[1, 3], None] and rows[1]["intervals"] == [[3, 4], [0, 2]]
    assert rows[0]["activity"] == [[0.0, 1.0, 2.0, 3.0, 4.0], [10.0, 11.0, 12.0, 13.0, 14.0]]
    assert rows[1]["next_tokens"] == ["<", "c", ">", "d", "<eos>"]
    assert len(activity_examples(activity, owners, ["a[b]", "<c>d"], examples=1)) == 1


def test_first_error_owner_golden():
    # Steps 1-2 (the segment and its marker) belong to expert 1 ("b"); the first errors of rows 1
    # and 4 fall at step 1, those of rows 2 and 3 at the END step (no owner), row 0 has none.
    owners = torch.tensor([[-1, 1, 1, -1, -1]] * 5)
    summary = failure_summary(GENERATED, TARGETS, LENGTHS, REGIONS, EOS, PAD, owners, ["a", "b"])
    assert summary["first_error_owner"] == pytest.approx({"a": 0.0, "b": 0.4})
    assert "first_error_owner" not in failure_summary(GENERATED, TARGETS, LENGTHS, REGIONS, EOS, PAD)
    with pytest.raises(ValueError, match="`owner_names` must name the experts"):
        failure_summary(GENERATED, TARGETS, LENGTHS, REGIONS, EOS, PAD, owners)
