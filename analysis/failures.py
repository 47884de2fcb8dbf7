"""Why a composition of k experts fails: termination, where the first error falls, background noise.

Pure functions on tensors; nothing here runs a model. Conventions:

* `generated` `(B, N)`: the tokens a system produced after the prompt, padded after its EOS
  (as `ComposedLM.generate` and `model.generate` leave them);
* `targets` `(B, M)`: the target tokens followed by EOS, padded; `target_lengths` `(B,)` the
  number of target tokens, so the EOS step of row b is `target_lengths[b]`;
* `regions` `(B, M)`: per output step, `BACKGROUND`, `SEGMENT`, `BOUNDARY` or `END` (the EOS
  step), from `mergecompose.studies.skills.region_labels`;
* `owners` `(B, T)`: per output step, the index of the expert whose segment (markers included)
  holds that target character, or -1 (`NO_OWNER`) outside every segment;
* `components` `(k+1, B, T, V)`: teacher-forced log-probs (base first) at the steps that predict
  each target token and the EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergecompose.analysis.diagnostics import expert_activity, kl_divergence
from mergecompose.composition import compose_logprobs

# Region labels of output steps: plain text, inside a skill's segment, a marker character where a
# skill starts or stops, and the EOS step one past the last character.
BACKGROUND, SEGMENT, BOUNDARY, END = 0, 1, 2, 3
REGION_NAMES = {BACKGROUND: "background", SEGMENT: "segment", BOUNDARY: "boundary", END: "end"}
NO_OWNER = -1  # owner of a step outside every expert's segment

EOS_ON_TIME, EOS_EARLY, EOS_LATE, EOS_MISSING = 0, 1, 2, 3
EOS_OUTCOME_NAMES = {EOS_ON_TIME: "on_time", EOS_EARLY: "early", EOS_LATE: "late", EOS_MISSING: "missing"}
EXACT = -1  # `first_errors` of a row with no error


def _check_batch(name: str, tensor: torch.Tensor, dims: int, batch: int | None = None) -> None:
    if tensor.dim() != dims:
        raise ValueError(f"`{name}` must have {dims} dimensions, got shape {tuple(tensor.shape)}")
    if batch is not None and tensor.shape[0] != batch:
        raise ValueError(f"`{name}` must hold {batch} rows (the batch of `generated`), got {tensor.shape[0]}")


def eos_positions(generated: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Index of the first EOS in each row of `generated` `(B, N)`, or N where there is none: `(B,)`."""
    _check_batch("generated", generated, 2)
    batch, steps = generated.shape
    if steps == 0:
        return torch.zeros(batch, dtype=torch.long, device=generated.device)
    is_eos = generated == eos_token_id  # (B, N)
    step_index = torch.arange(steps, device=generated.device)
    return torch.where(is_eos, step_index, steps).amin(-1)


def eos_outcomes(generated: torch.Tensor, target_lengths: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """How each row terminated, `(B,)` int64.

    With `e` the first EOS step and `L` the target length: `EOS_ON_TIME` if e = L, `EOS_EARLY`
    if e < L, `EOS_LATE` if L < e (an EOS was emitted, too late), `EOS_MISSING` if there is no
    EOS in the `N` generated steps at all. The outcome says nothing about the characters: a row
    with a wrong character can still stop on time.
    """
    _check_batch("target_lengths", target_lengths, 1, generated.shape[0])
    eos = eos_positions(generated, eos_token_id)  # (B,)
    lengths = target_lengths.to(eos.device)
    outcome = torch.full_like(eos, EOS_ON_TIME)
    outcome = torch.where(eos < lengths, EOS_EARLY, outcome)
    outcome = torch.where(eos > lengths, EOS_LATE, outcome)
    return torch.where(eos == generated.shape[1], EOS_MISSING, outcome)


def first_errors(
    generated: torch.Tensor, targets: torch.Tensor, target_lengths: torch.Tensor, pad_token_id: int
) -> torch.Tensor:
    """The first output step where `generated` differs from the target, EOS step included: `(B,)`.

    Steps `0 … L` are compared (L target tokens, then the EOS); a row that stopped or was cut
    before step L counts as wrong at the first step it did not produce. `EXACT` (-1) where the
    row is right through its EOS, i.e. an exact match.
    """
    _check_batch("generated", generated, 2)
    _check_batch("targets", targets, 2, generated.shape[0])
    _check_batch("target_lengths", target_lengths, 1, generated.shape[0])
    lengths = target_lengths.to(targets.device)
    if (lengths >= targets.shape[1]).any():
        raise ValueError(
            f"`targets` must hold each target and its EOS: {targets.shape[1]} columns, "
            f"but a target length is {int(lengths.max())}"
        )
    width = targets.shape[1]
    produced = torch.full_like(targets, pad_token_id)  # (B, M)
    columns = min(width, generated.shape[1])
    produced[:, :columns] = generated[:, :columns].to(targets.device)
    steps = torch.arange(width, device=targets.device)
    compared = steps[None] <= lengths[:, None]  # (B, M)
    wrong = (produced != targets) & compared
    # A step past the generated columns was never produced, even when the target there is a pad.
    wrong |= (steps[None] >= generated.shape[1]) & compared
    first = torch.where(wrong, steps, width).amin(-1)
    return torch.where(first == width, EXACT, first)


def first_error_regions(first: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """The region (`BACKGROUND`, `SEGMENT`, `BOUNDARY`, `END`) of each row's first error, or `EXACT`."""
    _check_batch("regions", regions, 2, first.shape[0])
    gathered = regions.gather(1, first.clamp(min=0)[:, None].to(regions.device))[:, 0]
    return torch.where(first.to(regions.device) == EXACT, EXACT, gathered)


def failure_summary(
    generated: torch.Tensor,
    targets: torch.Tensor,
    target_lengths: torch.Tensor,
    regions: torch.Tensor,
    eos_token_id: int,
    pad_token_id: int,
    owners: torch.Tensor | None = None,
    owner_names: Sequence[str] | None = None,
) -> dict:
    """Exact match, how rows terminated, and where (and as what) their first error fell.

    Returns a JSON-ready dict, every rate over all `B` rows:

    * `exact_match`;
    * `eos`: rates of `on_time`, `early`, `late`, `missing`;
    * `early_or_missing_eos`: `early + missing` (the issue's "early or missing EOS");
    * `first_error`: rates of `background`, `segment`, `boundary`, `end` (these and
      `exact_match` sum to 1); `end` means every character was right and the EOS was not;
    * `first_error_is_eos`: the first wrong token was an EOS, a premature stop;
    * with `owners` `(B, W)` (the owning expert per step, `NO_OWNER` elsewhere) and their
      `owner_names`: `first_error_owner`, per expert the rate of rows whose first error falls in
      that expert's segment (its markers included).
    """
    batch = generated.shape[0]
    if batch == 0:
        raise ValueError("`generated` must hold at least one row, got 0")
    first = first_errors(generated, targets, target_lengths, pad_token_id)  # (B,)
    where = first_error_regions(first, regions)
    outcomes = eos_outcomes(generated, target_lengths, eos_token_id)
    produced_at_first = torch.full_like(first, pad_token_id)
    inside = (first >= 0) & (first < generated.shape[1])
    produced_at_first[inside] = generated[inside, first[inside]]
    return {
        "n": batch,
        "exact_match": float((first == EXACT).float().mean()),
        "eos": {name: float((outcomes == code).float().mean()) for code, name in EOS_OUTCOME_NAMES.items()},
        "early_or_missing_eos": float(((outcomes == EOS_EARLY) | (outcomes == EOS_MISSING)).float().mean()),
        "first_error": {
            REGION_NAMES[code]: float((where == code).float().mean()) for code in (BACKGROUND, SEGMENT, BOUNDARY, END)
        },
        "first_error_is_eos": float((inside & (produced_at_first == eos_token_id)).float().mean()),
        **({} if owners is None else {"first_error_owner": _first_error_owners(first, owners, owner_names)}),
    }


def _first_error_owners(first: torch.Tensor, owners: torch.Tensor, names: Sequence[str] | None) -> dict[str, float]:
    _check_batch("owners", owners, 2, first.shape[0])
    if names is None:
        raise ValueError("`owner_names` must name the experts when `owners` is given, got None")
    owner = owners.gather(1, first.clamp(min=0, max=owners.shape[1] - 1)[:, None].to(owners.device))[:, 0]
    owner = torch.where(first.to(owners.device) == EXACT, NO_OWNER, owner)
    return {name: float((owner == index).float().mean()) for index, name in enumerate(names)}


# ---------------------------------------------------------------------------------------------
# Background noise: what the experts that should be silent add to the composition


def owner_weights(owners: torch.Tensor, num_experts: int) -> torch.Tensor:
    """One-hot exponents `(k, B, T)`: 1 for the expert that owns a step, 0 for all others."""
    if owners.min() < -1 or owners.max() >= num_experts:
        raise ValueError(
            f"`owners` must hold expert indices in [0, {num_experts}) or -1, got values in "
            f"[{int(owners.min())}, {int(owners.max())}]"
        )
    experts = torch.arange(num_experts, device=owners.device).view(-1, *([1] * owners.dim()))
    return (owners[None] == experts).float()


def background_noise(components: torch.Tensor, owners: torch.Tensor, eos_token_id: int) -> dict[str, torch.Tensor]:
    """How much the experts that do not own a step move the composition there, `(B, T)` each.

    With `δ_i = log p_i − log p_b` and `I_t` the experts other than the owner of step t:

    * `activity`: `(k, B, T)`, `a_{i,t} = KL(p_i ‖ p_b)` (`mergecompose.analysis.expert_activity`);
    * `inactive_activity`: `Σ_{i ∈ I_t} a_{i,t}`;
    * `eos_noise`: `Σ_{i ∈ I_t} δ_i(EOS)`, the log-odds the silent experts add to EOS; with
      the plain rule it adds to the composed EOS logit directly;
    * `oracle_shift`: `KL(q*_t ‖ q_t)`, from the oracle composition `q*` that uses only the
      owner (the base alone on background steps) to the plain composition `q` of all k experts.
      It is 0 when every non-owner equals the base, as joint factorizability assumes.
    * `oracle_flip`: 1.0 where `q` and `q*` have different argmax tokens: the silent experts
      change what greedy decoding emits at that step, else 0.0.

    Args:
        components: `(k+1, B, T, V)` log-probs or logits, base first.
        owners: `(B, T)` int, the owning expert per step or -1.
    """
    if components.dim() != 4:
        raise ValueError(f"`components` must be (k+1, batch, steps, vocab), got shape {tuple(components.shape)}")
    if tuple(owners.shape) != tuple(components.shape[1:3]):
        raise ValueError(f"`owners` must be (batch, steps) = {tuple(components.shape[1:3])}, got {tuple(owners.shape)}")
    components = torch.log_softmax(components.float(), dim=-1)  # (k+1, B, T, V)
    base, experts = components[0], components[1:]
    k = experts.shape[0]
    owned = owner_weights(owners.to(components.device), k)  # (k, B, T)
    silent = 1.0 - owned
    activity = expert_activity(base, experts)  # (k, B, T)
    eos_delta = experts[..., eos_token_id] - base[..., eos_token_id]  # (k, B, T)
    composed = compose_logprobs(base, list(experts))  # (B, T, V)
    oracle = compose_logprobs(base, list(experts), weights=owned)  # (B, T, V)
    return {
        "activity": activity,
        "inactive_activity": (activity * silent).sum(0),
        "eos_noise": (eos_delta * silent).sum(0),
        "oracle_shift": kl_divergence(oracle, composed),
        "oracle_flip": (oracle.argmax(-1) != composed.argmax(-1)).float(),
    }


def mean_by_region(
    values: torch.Tensor, regions: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float | None]:
    """Mean of `values` `(B, T)` over the steps of each region (`None` where a region has no step)."""
    if values.shape != regions.shape:
        raise ValueError(
            f"`values` and `regions` must have one shape, got {tuple(values.shape)} and {tuple(regions.shape)}"
        )
    keep = torch.ones_like(regions, dtype=torch.bool) if mask is None else mask.bool()
    means = {}
    for code, name in REGION_NAMES.items():
        selected = (regions == code) & keep
        means[name] = float(values[selected].float().mean()) if selected.any() else None
    return means


def spurious_activity_rate(
    activity: torch.Tensor, owners: torch.Tensor, epsilon: float, mask: torch.Tensor | None = None
) -> float:
    """Share of (expert, step) pairs where an expert is active (`a > ε`) on a step it does not own."""
    if not epsilon >= 0:
        raise ValueError(f"`epsilon` must be >= 0, got {epsilon}")
    silent = owner_weights(owners.to(activity.device), activity.shape[0]) == 0  # (k, B, T)
    if mask is not None:
        silent = silent & mask.bool()[None]
    count = int(silent.sum())
    return float(((activity > epsilon) & silent).sum()) / count if count else 0.0
