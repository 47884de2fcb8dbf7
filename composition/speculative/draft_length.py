"""How many tokens a speculative round drafts: K adapted to what drafting has cost and gained so far.

A round that drafts K tokens emits, at per-token acceptance a, E(a, K) = (1 − a^(K+1)) / (1 − a) tokens
on average (Leviathan et al., 2023) and takes T(K) seconds: K draft passes and one pass of the target
over K+1 tokens. K = 0 is a plain decoding step: one target pass, one token. Each round takes the K in
0…K_max with the most tokens a second, E(â, K) / T(K), from

* â: the acceptance rate seen so far, counts decayed by `decay` per round (recent rounds weigh more),
  starting from a prior of 1 accepted in 2 tests;
* T(K) = T(0) + K·t_d: T(0) the time of a plain step, t_d what a draft pass adds, both running means
  (weighted to recent rounds) of the timed rounds: plain steps time T(0), drafting rounds t_d.

The first round drafts one token (it also fills the caches with the prompt and is not timed), the
second is a plain step, which times T(0). Until a drafting round has been timed, t_d is taken as
T(0) · `draft_cost`, the draft's parameters over those the target reads in a pass: a round drafts
again only if that estimate says it pays, and is then timed. A poor draft so costs its prompt pass
and one or two draft passes before decoding falls back, a good one a few tokens before K grows. When
plain steps have won `first_probe` rounds in a row, one round drafts again, so that a draft that has
become good (a later part of the text it predicts well) is noticed. The first wait is short: a fallback
is often decided on one or two tests, and a good draft whose first token was rejected (the prior of 1
in 2 then falls to 0.31) would otherwise decode plainly for 64 tokens. Each probe that does not bring
drafting back sets the wait to at least `probe_every` rounds, and doubles it after that. A round whose
draft first had to catch up with more than three tokens it had not seen (after several plain steps) is
not timed: that pass costs more than one.

Any K keeps decoding exact: the acceptance rule holds round by round. Greedy output is therefore the
same token for token; sampling stays exact in distribution, but which tokens a seed draws depends on
the K chosen, which depends on timings: use `adaptive=False` (fixed K) for draws that repeat run to run.
"""

from __future__ import annotations

import math


def expected_tokens(acceptance: float, draft_tokens: int) -> float:
    """E(a, K) = (1 − a^(K+1)) / (1 − a): the tokens a round of K drafts emits on average (K + 1 at a = 1)."""
    if acceptance >= 1:
        return float(draft_tokens + 1)
    return (1 - acceptance ** (draft_tokens + 1)) / (1 - acceptance)


class DraftLength:
    """The K of each round (module docstring); `adaptive=False` always gives K_max."""

    def __init__(
        self,
        max_draft_tokens: int,
        adaptive: bool = True,
        *,
        draft_cost: float = 1.0,
        decay: float = 0.8,
        first_probe: int = 8,
        probe_every: int = 64,
    ) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.draft_cost = draft_cost
        self.adaptive = adaptive
        self.decay = decay
        self.probe_every = probe_every
        self.wait = first_probe  # plain rounds in a row before the next probe
        self.accepted, self.tested = 1.0, 2.0  # the prior: a = 0.5
        self.plain_seconds: float | None = None  # T(0)
        self.draft_pass_seconds: float | None = None  # t_d
        self.rounds = 0
        self.plain_in_a_row = 0
        self.probing = False  # the last round was a probe

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tested

    def next(self) -> int:
        """K for the coming round."""
        self.rounds += 1
        if not self.adaptive:
            return self.max_draft_tokens
        if self.rounds == 1:
            return 1
        if self.rounds == 2:
            return 0
        best = self.best()
        self.probing = best == 0 and self.plain_in_a_row >= self.wait
        return self.best(minimum=1) if self.probing else best

    def best(self, minimum: int = 0) -> int:
        """The K in minimum…K_max with the most expected tokens a second."""
        rates = {
            k: expected_tokens(self.acceptance, k) / self.seconds(k) for k in range(minimum, self.max_draft_tokens + 1)
        }
        return max(rates, key=lambda k: (rates[k], -k))

    def seconds(self, draft_tokens: int) -> float:
        """T(K) = T(0) + K·t_d (t_d = T(0) · draft_cost until timed); before T(0) is timed, K > 0 is infinite."""
        if self.plain_seconds is None:
            return 1.0 if draft_tokens == 0 else math.inf
        if draft_tokens == 0:
            return self.plain_seconds
        per_pass = self.plain_seconds * self.draft_cost if self.draft_pass_seconds is None else self.draft_pass_seconds
        return self.plain_seconds + draft_tokens * per_pass

    def update(self, draft_tokens: int, accepted: float, tested: float, seconds: float | None) -> None:
        """What the round did: its K, the drafts accepted of those tested, and its time (None: not timed)."""
        if tested:
            self.accepted = self.decay * self.accepted + accepted
            self.tested = self.decay * self.tested + tested
        self.plain_in_a_row = self.plain_in_a_row + 1 if draft_tokens == 0 else 0
        if seconds is not None and self.rounds > 1:
            if draft_tokens == 0:
                self.plain_seconds = _running(self.plain_seconds, seconds)
            elif self.plain_seconds is not None:
                per_pass = max(seconds - self.plain_seconds, 0.0) / draft_tokens
                self.draft_pass_seconds = _running(self.draft_pass_seconds, per_pass)
        if self.probing and self.best() == 0:
            self.wait = max(self.probe_every, 2 * self.wait)  # the probe did not bring drafting back: wait longer


def _running(previous: float | None, value: float) -> float:
    return value if previous is None else 0.7 * previous + 0.3 * value
