"""Held-out data, and exact match of a loaded system with 95 % confidence intervals.

**Exact match** is that of the greedy output up to EOS. It is computed in one teacher-forced
pass: greedy decoding reproduces the target `y_1 … y_L <eos>` exactly iff, at every target
position, the argmax given the target's own prefix is the next target token (by induction on
the steps). So `correct = all_t [argmax p(· | prefix_t) = label_t]`, and the first t where it
fails is where greedy decoding would first go wrong. The aligned formulation has no decoding:
its output is the argmax at every position, which is the same test. `greedy_agreement` then
decodes a sample for real (`generate`, KV cache) and checks that both verdicts agree.

**Confidence interval:** Wilson's score interval at 95 % (scipy's `binomtest(...).proportion_ci`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import binomtest

from mergecompose.experiments.formats import IGNORE_INDEX, SequenceFormat
from mergecompose.experiments.scored_systems import ScoredModel
from mergecompose.experiments.tokenizer import decode_ids, encode_strings

# The split every task type must have: inputs that need every composed skill, scored on the joint target.
JOINT = "joint"


@dataclass(frozen=True)
class EvalSet:
    """Strings of one length and their targets."""

    name: str
    length: int
    sources: tuple[str, ...]
    targets: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.sources)

    def head(self, count: int) -> EvalSet:
        return EvalSet(self.name, self.length, self.sources[:count], self.targets[:count])


@dataclass
class EvalData:
    """`test` and `validation`: the named splits, scored on the joint target. `curves[kind][L]`: own targets.

    kinds: `copy` (the base), `skill:<name>` (each expert), `joint` (compose and merges).
    """

    test: dict[str, EvalSet]
    validation: dict[str, EvalSet]
    curves: dict[str, dict[int, EvalSet]]


# ---------------------------------------------------------------------------------- scoring


@dataclass
class Scored:
    """Per-example verdicts: `correct` (n,) and the first wrong target index (-1 where correct)."""

    correct: np.ndarray
    first_error: np.ndarray


def teacher_forced_verdicts(logprobs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-match verdicts from `(B, T, V)` log-probs and `(B, T)` labels (IGNORE_INDEX where none).

    Returns `correct` (B,) — every labelled position's argmax equals its label — and
    `first_error` (B,): the index, among the row's labelled positions, of the first wrong one
    (-1 where the row is correct).
    """
    predicted = logprobs.argmax(dim=-1)  # (B, T)
    labelled = labels != IGNORE_INDEX  # (B, T)
    wrong = (predicted != labels) & labelled  # (B, T)
    correct = ~wrong.any(dim=-1)  # (B,)
    target_index = labelled.long().cumsum(dim=-1) - 1  # (B, T): index of each labelled position
    first_wrong_column = torch.where(wrong, torch.arange(wrong.shape[1]), wrong.shape[1]).min(dim=-1).values  # (B,)
    first_error = torch.full_like(correct, -1, dtype=torch.long)
    rows = (~correct).nonzero().flatten()
    first_error[rows] = target_index[rows, first_wrong_column[rows]]
    return correct, first_error


def score(model: ScoredModel, eval_set: EvalSet, fmt: SequenceFormat, tokenizer, batch_size: int) -> Scored:
    """Teacher-forced exact match of `model` on every example of `eval_set`."""
    sources = encode_strings(tokenizer, eval_set.sources)
    targets = encode_strings(tokenizer, eval_set.targets)
    correct, first_error = [], []
    for start in range(0, len(sources), batch_size):
        batch = fmt.batch(sources[start : start + batch_size], targets[start : start + batch_size])
        verdicts = teacher_forced_verdicts(model.logprobs(batch), batch.labels)
        correct.append(verdicts[0].numpy())
        first_error.append(verdicts[1].numpy())
    return Scored(np.concatenate(correct), np.concatenate(first_error))


def greedy_tokens(
    model: ScoredModel, sources: list[list[int]], fmt: SequenceFormat, tokenizer, max_new_tokens: int, batch_size: int
) -> torch.Tensor:
    """Greedy output tokens `(n, max_new_tokens)` of `model` (KV-cached `generate`), padded after its EOS or stop."""
    rows = [torch.empty((0, max_new_tokens), dtype=torch.long)]
    for start in range(0, len(sources), batch_size):
        prompt = fmt.prompt(sources[start : start + batch_size], max_new_tokens)
        generated = model.generate(prompt, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
        padded = torch.full((generated.shape[0], max_new_tokens), tokenizer.pad_token_id, dtype=torch.long)
        padded[:, : generated.shape[1]] = generated
        rows.append(padded)
    return torch.cat(rows)


def greedy_outputs(model: ScoredModel, eval_set: EvalSet, fmt: SequenceFormat, tokenizer, batch_size: int) -> list[str]:
    """Greedy decoding for real (seq2seq): each output up to its first `<eos>` (at most L + 2 tokens)."""
    sources = encode_strings(tokenizer, eval_set.sources)
    generated = greedy_tokens(model, sources, fmt, tokenizer, eval_set.length + 2, batch_size)
    outputs = []
    for row in generated.tolist():
        text = decode_ids(tokenizer, row)
        outputs.append(text if tokenizer.eos_token_id in row else text + "…")  # no <eos>: never an exact match
    return outputs


def greedy_agreement(
    model: ScoredModel, eval_set: EvalSet, fmt: SequenceFormat, tokenizer, batch_size: int, scored: Scored
) -> dict:
    """How many of `eval_set`'s examples get the same verdict from real greedy decoding and from `scored`."""
    outputs = greedy_outputs(model, eval_set, fmt, tokenizer, batch_size)
    greedy_correct = np.array([output == target for output, target in zip(outputs, eval_set.targets)])
    agree = int((greedy_correct == scored.correct[: len(outputs)]).sum())
    return {
        "split": eval_set.name,
        "n": len(outputs),
        "agree": agree,
        "greedy_exact_match": float(greedy_correct.mean()),
    }


def summary(scored: Scored) -> dict:
    """`{"exact_match", "n", "ci95": [lo, hi], "first_error": {index: count}}` (Wilson interval)."""
    n = int(scored.correct.size)
    k = int(scored.correct.sum())
    low, high = wilson_interval(k, n)
    errors = Counter(int(index) for index in scored.first_error if index >= 0)
    return {
        "exact_match": k / n,
        "n": n,
        "ci95": [low, high],
        "first_error": {str(index): count for index, count in sorted(errors.items())},
    }


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (scipy's definition)."""
    if trials < 1:
        raise ValueError(f"`trials` must be >= 1, got {trials}")
    interval = binomtest(successes, trials).proportion_ci(confidence_level=confidence, method="wilson")
    return float(interval.low), float(interval.high)


def mean_exact_match(
    model: ScoredModel, sets: Sequence[EvalSet], fmt: SequenceFormat, tokenizer, batch_size: int
) -> float:
    """The unweighted mean of exact match over `sets` (merge selection on validation)."""
    return float(np.mean([score(model, eval_set, fmt, tokenizer, batch_size).correct.mean() for eval_set in sets]))
