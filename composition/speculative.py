"""Exact speculative sampling of the composed distribution (Leviathan et al., 2023; Chen et al., 2023).

A draft model q proposes K tokens, one forward pass each; the k+1 components then score all K+1
positions in one forward pass each, and the composed target p̂ decides, position by position:

    accept x_j with probability α_j = min(1, p̂_j(x_j) / q_j(x_j));
    at the first rejection emit y ~ norm(max(0, p̂_j − q_j)) and stop;
    if all K are accepted, emit a bonus token y ~ p̂_{K+1}.

Whatever q is, every emitted token is distributed exactly as p̂ given the tokens before it: a good
draft only makes it faster. Greedy decoding accepts while the draft's token is the target's argmax.
The rule is written here as pure functions on probability tensors (`outcome_probabilities` gives
the probability of every outcome of a round), which the tests enumerate exactly.

The natural draft for a composition is the parameter-space merge of the same experts (task
arithmetic, θ_b + Σ_i λ_i (θ_i − θ_b), Ilharco et al. 2023): one forward pass instead of k+1,
and equal to the composition where the linear-equivalence story holds (see PAPER.md).
`merged_full_draft` and `merged_lora_draft` build it in memory.

Batches: each row accepts its own number of tokens. The caches are cut back to the longest
acceptance of the batch (`DynamicCache.crop`, which is also the stacked-LoRA path's one cache);
a row that accepted fewer keeps its rejected columns as masked holes (attention mask 0), so its
tokens and their positions are exactly those of plain decoding. At batch 1 there are no holes.
A sliding window counts columns, not tokens; for such models every row advances by the batch's
shortest acceptance instead (`speculative_decode`'s `holes=False`), which is exact too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from peft.tuners.lora.layer import LoraLayer

from mergecompose.core.adapters import load_adapters_on_base

# ---------------------------------------------------------------------------------- the rule


def acceptance_probabilities(target: torch.Tensor, draft: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """α_j = min(1, p_j(x_j) / q_j(x_j)) for each drafted token x_j.

    Args:
        target: `(..., K(+1), V)` target probabilities p_j (a trailing bonus position is ignored).
        draft: `(..., K, V)` draft probabilities q_j, from which the x_j were drawn (so q_j(x_j) > 0).
        draft_tokens: `(..., K)` the drafted tokens x_j.
    Returns:
        `(..., K)` acceptance probabilities in [0, 1].
    """
    count = draft_tokens.shape[-1]
    index = draft_tokens.unsqueeze(-1)  # (..., K, 1)
    p = target[..., :count, :].gather(-1, index).squeeze(-1)  # (..., K)
    q = draft.gather(-1, index).squeeze(-1)  # (..., K)
    return torch.where(p >= q, torch.ones_like(p), p / q.clamp(min=torch.finfo(q.dtype).tiny))


def residual_distributions(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): where a rejected position draws its token. `(..., V)` each, same shape out.

    Where p ≤ q everywhere (p = q), nothing is ever rejected (α = 1); p itself is returned there, so
    that the result is a distribution and never 0/0."""
    excess = (target - draft).clamp(min=0)  # (..., V)
    total = excess.sum(-1, keepdim=True)  # (..., 1)
    return torch.where(total > 0, excess / torch.where(total > 0, total, torch.ones_like(total)), target)


def round_outcomes(acceptance: torch.Tensor, residuals: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """The probability of each outcome of a round: `P[n, y]` = P(the first n drafts accepted, then y emitted).

        P[n, y] = Π_{j<n} α_j · (1 − α_n) · r_n(y)     for n < K   (rejected at n+1, y from the residual)
        P[K, y] = Π_{j<K} α_j · p_{K+1}(y)                          (all accepted, y is the bonus token)

    Args:
        acceptance: `(..., K)` α_j; residuals: `(..., K, V)` r_j; bonus: `(..., V)` p_{K+1}.
    Returns:
        `(..., K+1, V)`, summing to 1 over its last two dimensions.
    """
    ones = acceptance.new_ones((*acceptance.shape[:-1], 1))  # (..., 1)
    reached = torch.cat([ones, acceptance], dim=-1).cumprod(-1)  # (..., K+1): Π_{j<n} α_j
    stops = torch.cat([1 - acceptance, ones], dim=-1)  # (..., K+1): P(stop at n | reached n)
    next_token = torch.cat([residuals, bonus.unsqueeze(-2)], dim=-2)  # (..., K+1, V)
    return (reached * stops).unsqueeze(-1) * next_token


def outcome_probabilities(target: torch.Tensor, draft: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """`round_outcomes` of the acceptance rule: target `(..., K+1, V)`, draft `(..., K, V)`, tokens `(..., K)`.

    Drawing one (n, y) from this table is the sequential test (accept with α_j, at the first rejection
    draw from the residual), in one draw. Summed over n and the paths that lead to a token, it gives
    the target: P(first emitted = y) = min(p_1, q_1)(y) + (1 − Σ min(p_1, q_1)) · r_1(y) = p_1(y)."""
    count = draft_tokens.shape[-1]
    return round_outcomes(
        acceptance_probabilities(target, draft, draft_tokens),
        residual_distributions(target[..., :count, :], draft),
        target[..., count, :],
    )


def greedy_accepted(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """How many drafts greedy decoding accepts: the length of the run where draft = target argmax.

    target_tokens `(..., K+1)` (argmax at each position), draft_tokens `(..., K)` -> `(...,)` in [0, K]."""
    count = draft_tokens.shape[-1]
    return (draft_tokens == target_tokens[..., :count]).long().cumprod(-1).sum(-1)


def round_tokens(draft_tokens: torch.Tensor, accepted: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The tokens a round emits, `(B, K+1)`: row r's first `accepted[r] + 1` are its accepted drafts, then its y.

    draft_tokens `(B, K)`, accepted `(B,)`, next_tokens `(B,)` (the residual or bonus token)."""
    tokens = torch.cat([draft_tokens, next_tokens.unsqueeze(-1)], dim=-1)  # (B, K+1)
    return tokens.scatter(-1, accepted.unsqueeze(-1), next_tokens.unsqueeze(-1))


# ---------------------------------------------------------------------------------- merged drafts


def task_arithmetic_state_dict(
    base_state: Mapping[str, torch.Tensor],
    expert_states: Sequence[Mapping[str, torch.Tensor]],
    lambdas: Sequence[float],
) -> dict[str, torch.Tensor]:
    """θ = θ_b + Σ_i λ_i (θ_i − θ_b) for every floating tensor; other tensors are the base's.

    Computed in float32 (float64 for a float64 tensor) and cast back to the base's dtype, as
    `mergecompose.merging.merge("task_arithmetic", ..., weights=λ, lam=1)` computes it (pinned in the tests).
    Tensors tied in the base (one storage under two names) are merged once and stay shared.
    Raises a ValueError naming the expert and the tensor if the experts' names or shapes differ.
    """
    names = set(base_state)
    for index, state in enumerate(expert_states):
        if set(state) != names:
            different = sorted(names ^ set(state))[:3]
            raise ValueError(
                f"draft='merged' needs experts with the base's parameter names; `expert_models[{index}]` differs "
                f"in {different}"
            )
    merged: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}  # (storage pointer, shape, dtype) of a base tensor -> its merged tensor
    for name, base in base_state.items():
        if not base.is_floating_point():
            merged[name] = base
            continue
        key = (base.data_ptr(), tuple(base.shape), base.dtype)
        if key not in done:
            dtype = torch.float64 if base.dtype == torch.float64 else torch.float32
            delta = torch.zeros(base.shape, dtype=dtype, device=base.device)
            for index, (state, scale) in enumerate(zip(expert_states, lambdas)):
                if state[name].shape != base.shape:
                    raise ValueError(
                        f"draft='merged' needs experts of the base's shapes; `expert_models[{index}]`'s `{name}` has "
                        f"shape {tuple(state[name].shape)}, the base's {tuple(base.shape)}"
                    )
                delta += scale * (state[name].to(device=base.device, dtype=dtype) - base.to(dtype))
            done[key] = (base.to(dtype) + delta).to(base.dtype)
        merged[name] = done[key]
    return merged


def model_with_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A new model of `model`'s class and config holding `state_dict`'s tensors themselves (no copy).

    Built on the meta device, so no memory is allocated for weights that are then replaced; the
    buffers that are not saved (rotary frequencies) are `model`'s own. `model` is never modified:
    what the new model shares with it, it only reads."""
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.load_state_dict(dict(state_dict), strict=True, assign=True)
    saved = set(state_dict)
    for name, buffer in _plain_named(model.named_buffers()):
        if name not in saved:  # a buffer that is not saved, e.g. RoPE's inverse frequencies
            module_path, _, attribute = name.rpartition(".")
            copy.get_submodule(module_path)._buffers[attribute] = buffer
    copy.generation_config = getattr(model, "generation_config", None)
    return copy.eval().requires_grad_(False)


def merged_full_draft(base_model: torch.nn.Module, expert_models: Sequence[torch.nn.Module], lambdas: Sequence[float]):
    """The task-arithmetic merge of full experts as a model: θ_b + Σ_i λ_i (θ_i − θ_b)."""
    base_state = base_model.state_dict()
    merged = task_arithmetic_state_dict(base_state, [expert.state_dict() for expert in expert_models], lambdas)
    return model_with_weights(base_model, merged)


def merged_lora_draft(base_model: torch.nn.Module, adapters: Mapping[str, object], lambdas: Sequence[float]):
    """The task-arithmetic merge of LoRA experts as a model: W + Σ_i λ_i ΔW_i in every adapted layer.

    ΔW_i is peft's `LoraLayer.get_delta_weight` (its scaling, rsLoRA and fan-in-fan-out layouts).
    `base_model` may carry the composition's LoRA layers (peft) or its stacked forwards: only its
    plain weights are read (`*.base_layer.*` renamed, `lora_*` dropped). Tensors the adapters do not
    change are shared with it; adapted weights are new tensors.
    """
    plain = dict(_plain_named(base_model.state_dict().items()))
    draft = model_with_weights(base_model, plain)
    peft_model, names = load_adapters_on_base(draft, adapters)
    scales = dict(zip(names, lambdas))
    with torch.no_grad():
        for path, module in peft_model.get_base_model().named_modules():
            if not isinstance(module, LoraLayer):
                continue
            present = [name for name in names if name in module.lora_A]
            if any(name in getattr(module, "lora_variant", {}) for name in present):
                raise ValueError(f"draft='merged' cannot merge module `{path}`: it uses a LoRA variant (e.g. DoRA)")
            layer = module.get_base_layer()
            weight = layer.weight
            for name in present:
                weight = weight + scales[name] * module.get_delta_weight(name).to(weight.dtype)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)  # a new tensor: the base's stays as it was
    return peft_model.unload().eval()


def _plain_named(items):
    """(name, tensor) pairs of a model that may carry peft LoRA layers, as the plain model names them."""
    for name, tensor in items:
        if "lora_" not in name:
            yield name.replace(".base_layer.", "."), tensor


# ---------------------------------------------------------------------------------- the decoding loop


@dataclass
class SpeculationStats:
    """What one speculative `generate` call did, summed over the rows still generating.

    Attributes:
        num_draft_tokens: K asked for (a round drafts fewer where fewer tokens remain).
        rounds: verification steps (one forward pass of every component each).
        row_rounds: rounds summed over the rows that took part in them.
        draft_passes: forward passes of the draft.
        drafted: drafted tokens; tested: acceptance tests (every accepted draft and each round's
            first rejection); accepted: accepted drafts.
        emitted: tokens emitted (accepted drafts and one residual or bonus token a round, up to EOS
            and `max_new_tokens`).
    """

    num_draft_tokens: int
    rounds: int = 0
    row_rounds: int = 0
    draft_passes: int = 0
    drafted: int = 0
    tested: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """a = accepted / tested, the per-token acceptance rate of Leviathan et al.'s analysis (NaN before any test).

        With a, a round of K drafts emits E = (1 − a^(K+1)) / (1 − a) tokens on average."""
        return self.accepted / self.tested if self.tested else math.nan

    @property
    def tokens_per_round(self) -> float:
        """Tokens a row emitted per round, on average (E in the formula above)."""
        return self.emitted / self.row_rounds if self.row_rounds else math.nan

    def as_dict(self) -> dict:
        return {**vars(self), "acceptance_rate": self.acceptance_rate, "tokens_per_round": self.tokens_per_round}


def attention_bias(mask: torch.Tensor, first: int, dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive attention mask of a pass over columns `first…C−1` of `mask` `(B, C)`: `(B, 1, C − first, C)`.

    0 where the query may attend the key (the key is a token, mask 1, and not after the query), the
    dtype's minimum elsewhere, as eager and SDPA attention add it. transformers takes a 4D mask as
    given; for several query tokens that skips building one (on the letters models a pass over 5
    tokens then costs 1.1 passes over one instead of 1.3)."""
    columns = mask.shape[1]
    keys = torch.arange(columns, device=mask.device)
    allowed = (keys <= torch.arange(first, columns, device=mask.device).unsqueeze(1)) & mask.bool().unsqueeze(
        1
    )  # (B, q, C)
    return (
        torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        .masked_fill_(~allowed, torch.finfo(dtype).min)
        .unsqueeze(1)
    )


def _new_cache(backend):
    """A fresh cache that can be cut back; sliding-window layers keep their past until `crop` (transformers 5)."""
    cache = backend.new_cache()
    for each in cache if isinstance(cache, list) else [cache]:
        if hasattr(each, "activate_past_recording"):
            each.activate_past_recording()
    return cache


def _roll_back(cache, tokens: int) -> None:
    """Drop the last `tokens` positions of a cache (or of each cache in a list).

    `crop(-n)` removes n; with past recording on, `crop(0)` still trims sliding-window layers back to
    their window, as transformers' own assisted decoding does after every step."""
    for each in cache if isinstance(cache, list) else [cache]:
        if tokens > 0 or hasattr(each, "activate_past_recording"):
            each.crop(-tokens)


@torch.no_grad()
def speculative_decode(
    target,
    draft,
    compose: Callable[[torch.Tensor], torch.Tensor],
    probabilities: Callable[[torch.Tensor], torch.Tensor] | None,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    max_new_tokens: int,
    num_draft_tokens: int,
    pad_id: int,
    eos_ids: torch.Tensor | None = None,
    stop_criteria=None,
    generator: torch.Generator | None = None,
    holes: bool = True,
    bias_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
) -> tuple[torch.Tensor, SpeculationStats, torch.Tensor]:
    """Decode with a draft; returns (sequences `(B, P + n)`, statistics, a greedy-NaN flag on the device).

    Args:
        target: the composition's backend: `forward(ids, mask, positions, cache, logits_to_keep)`
            -> `(k+1, B, T, V)` logits, and `new_cache()`.
        draft: the draft model behind the same interface (one component).
        compose: `(k+1, B, T, V)` logits -> `(B, T, V)` composed scores (the remedies applied).
        probabilities: `(B, T, V)` scores -> `(B, T, V)` probabilities after the sampling warpers,
            applied to the target and to the draft alike; None for greedy decoding.
        input_ids, attention_mask: the left-padded prompt `(B, P)`.
        positions: `(B, P + max_new_tokens)`, the prompt's positions, then each generated token's.
        eos_ids, stop_criteria, pad_id: as in `ComposedLM.generate`: a row that emits EOS or
            completes a stop string is finished, and pad fills its later positions.
        holes: rows that accepted fewer drafts than the batch's longest keep masked holes. False
            for models whose sliding window counts columns, not tokens: then every row advances by
            the batch's shortest acceptance, a row that accepted more emitting its next accepted
            draft as its last token (a prefix of an exact round's output is exact), and no column
            is ever masked.
        bias_dtypes: for the target and the draft, the dtype of a 4D additive mask (`attention_bias`)
            to pass where a pass reads several tokens, or None to pass the 2D mask. Only for models
            that apply one mask to every layer (no sliding window) with eager or SDPA attention.
    """
    device = input_ids.device
    batch, prompt_length = input_ids.shape
    greedy = probabilities is None
    generated_positions = positions[:, prompt_length:]  # (B, max_new_tokens)
    # Physical columns: each round keeps at most K+1, and every row emits at least one token a round.
    width = prompt_length + max_new_tokens * (num_draft_tokens + 1)
    tokens = torch.full((batch, width), pad_id, dtype=input_ids.dtype, device=device)
    tokens[:, :prompt_length] = input_ids
    mask = torch.zeros((batch, width), dtype=attention_mask.dtype, device=device)
    mask[:, :prompt_length] = attention_mask
    column_positions = torch.zeros((batch, width), dtype=positions.dtype, device=device)
    column_positions[:, :prompt_length] = positions[:, :prompt_length]
    # The output, with room for one round past the end (writes there are dropped).
    output = torch.full(
        (batch, prompt_length + max_new_tokens + num_draft_tokens + 1), pad_id, dtype=input_ids.dtype, device=device
    )
    output[:, :prompt_length] = input_ids
    emitted = torch.zeros(batch, dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    invalid = torch.zeros((), dtype=torch.bool, device=device)
    offsets = torch.arange(num_draft_tokens + 1, device=device)
    stats = SpeculationStats(num_draft_tokens)

    def position_of(index: torch.Tensor) -> torch.Tensor:
        """(B, n) positions of each row's generated tokens number `index` (B, n) (past the end: the last one; never emitted)."""
        return generated_positions.gather(1, index.clamp(max=max_new_tokens - 1))

    def mask_for(first: int, bias_dtype) -> torch.Tensor:
        """The attention mask of a pass over columns first…columns−1."""
        if bias_dtype is None or columns - first == 1:
            return mask[:, :columns]
        return attention_bias(mask[:, :columns], first, bias_dtype)

    target_cache, draft_cache = _new_cache(target), _new_cache(draft)
    target_cached = draft_cached = 0  # columns each cache holds
    columns = prompt_length  # columns in use; the last one holds each row's newest token
    remaining = max_new_tokens  # the most tokens a row still generating may emit
    while True:
        count = min(num_draft_tokens, remaining - 1)
        start = columns  # the round's first draft column
        mask[:, start : start + count] = 1
        column_positions[:, start : start + count] = position_of(emitted.unsqueeze(1) + offsets[:count])
        draft_probabilities = []
        for _step in range(count):
            logits = draft.forward(
                tokens[:, draft_cached:columns],
                mask_for(draft_cached, bias_dtypes[1]),
                column_positions[:, draft_cached:columns],
                draft_cache,
                logits_to_keep=1,
            )[0, :, -1]  # (B, V)
            draft_cached = columns
            if greedy:
                proposed = logits.argmax(-1)  # (B,)
            else:
                q = probabilities(torch.log_softmax(logits.float(), dim=-1).unsqueeze(1)).squeeze(1)  # (B, V)
                if torch.isnan(q).any():
                    raise ValueError(
                        "the draft produced NaN probabilities (NaN or +inf logits); check its weights and dtype"
                    )
                draft_probabilities.append(q)
                proposed = torch.multinomial(q, 1, generator=generator).squeeze(1)  # (B,)
            tokens[:, columns] = proposed
            columns += 1
        stats.draft_passes += count

        logits = target.forward(
            tokens[:, target_cached:columns],
            mask_for(target_cached, bias_dtypes[0]),
            column_positions[:, target_cached:columns],
            target_cache,
            logits_to_keep=count + 1,
        )  # (k+1, B, count+1, V)
        target_cached = columns
        scores = compose(logits)  # (B, count+1, V)
        drafts = tokens[:, start:columns]  # (B, count)
        if greedy:
            invalid |= torch.isnan(scores).any()
            best = scores.argmax(-1)  # (B, count+1)
            accepted = greedy_accepted(best, drafts)  # (B,)
            next_tokens = best.gather(1, accepted.unsqueeze(1)).squeeze(1)  # (B,)
        else:
            p = probabilities(scores)  # (B, count+1, V)
            q = torch.stack(draft_probabilities, dim=1) if count else p[:, :0]  # (B, count, V)
            table = outcome_probabilities(p, q, drafts).flatten(1)  # (B, (count+1)·V)
            choice = torch.multinomial(table, 1, generator=generator).squeeze(1)  # (B,)
            accepted, next_tokens = choice // p.shape[-1], choice % p.shape[-1]
        # Emit: each row still generating takes its accepted drafts and y, up to max_new_tokens and EOS.
        active = unfinished & (emitted < max_new_tokens)
        tests = torch.where(active, torch.where(accepted < count, accepted + 1, accepted), 0)  # before any cut
        accepted_total = torch.where(active, accepted, 0).sum()
        if not holes and count:
            shortest = torch.where(active, accepted, count).min()
            cut_draft = drafts.gather(1, shortest.clamp(max=count - 1).expand(batch, 1)).squeeze(1)
            next_tokens = torch.where(accepted > shortest, cut_draft, next_tokens)
            accepted = torch.minimum(accepted, shortest)
        new_tokens = round_tokens(drafts, accepted, next_tokens)  # (B, count+1)
        take = torch.where(active, torch.minimum(accepted + 1, max_new_tokens - emitted), 0)  # (B,)
        step_offsets = offsets[: count + 1]
        if eos_ids is not None:
            is_eos = torch.isin(new_tokens, eos_ids) & (step_offsets < take.unsqueeze(1))  # (B, count+1)
            ends = is_eos.any(1)
            take = torch.where(ends, is_eos.long().argmax(1) + 1, take)  # up to and including the first EOS
            unfinished &= ~ends
        if stop_criteria is not None:
            take = _stop_within(stop_criteria, output, prompt_length, emitted, new_tokens, take, unfinished)
        written = torch.where(step_offsets < take.unsqueeze(1), new_tokens, pad_id)
        output.scatter_(1, prompt_length + emitted.unsqueeze(1) + step_offsets, written)
        before = emitted
        emitted = emitted + take

        # One read from the device a round: the longest acceptance and what is left to do.
        still = unfinished & (emitted < max_new_tokens)
        summary = torch.stack(
            [
                torch.where(active, accepted, 0).max(),
                torch.where(still, max_new_tokens - emitted, 0).max(),
                active.sum(),
                tests.sum(),
                accepted_total,
                take.sum(),
            ]
        ).tolist()
        longest, remaining, rows, tested, accepted_total, emitted_total = summary
        stats.rounds += 1
        stats.row_rounds += rows
        stats.drafted += count * rows
        stats.tested += tested
        stats.accepted += accepted_total
        stats.emitted += emitted_total
        if remaining == 0:
            break

        # Roll back to the longest acceptance; rows that accepted fewer keep masked holes.
        keep = start + longest
        mask[:, start:keep] = (step_offsets[:longest] < accepted.unsqueeze(1)).to(mask.dtype)
        _roll_back(target_cache, target_cached - keep)
        target_cached = keep
        if draft_cached:
            _roll_back(draft_cache, max(0, draft_cached - keep))
            draft_cached = min(draft_cached, keep)
        columns = keep
        tokens[:, columns] = next_tokens
        mask[:, columns] = 1
        column_positions[:, columns] = position_of((before + accepted).unsqueeze(1)).squeeze(1)
        columns += 1
    return output[:, : prompt_length + int(emitted.max())], stats, invalid


def _stop_within(stop_criteria, output, prompt_length, emitted, new_tokens, take, unfinished) -> torch.Tensor:
    """Cut each row's `take` at the first token that completes a stop string (marking the row finished).

    The criteria see a row's generated tokens 1…t after each token t, as in plain decoding; rows
    are checked in groups of equal length, since the criteria take a rectangular batch."""
    take = take.clone()
    for step in range(new_tokens.shape[1]):
        rows = (step < take).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        before = emitted[rows]  # tokens written before this round
        for count in before.unique().tolist():
            group = rows[before == count]
            generated = torch.cat(
                [output[group, prompt_length : prompt_length + count], new_tokens[group, : step + 1]], 1
            )
            stopped = group[stop_criteria(generated, None)]
            take[stopped] = step + 1
            unfinished[stopped] = False
    return take
