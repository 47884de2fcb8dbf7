"""The skills task's results sections: how each combined system fails, and the background noise behind it.

`failure_section(context)` is a `mergecompose.experiments.compare` section (stored as `results["skills_failures"]`):

* for every `compose*` and `merge:*` system, on `joint` and every `length_<L>` split, real
  greedy decoding (KV-cached, `max_new_tokens` = L + `margin`) summarised by
  `mergecompose.analysis.failures.failure_summary`: exact match, early / late / missing EOS, and the
  region of the first error;
* for the plain composition, teacher-forced on the joint targets, what the experts that do
  not own a step add there (`background_noise`), averaged per region, with the co-activation
  rate and the spurious-activity rate at the activity threshold ε.
"""

from __future__ import annotations

import torch

from mergecompose.analysis import coactivation_rate
from mergecompose.analysis.failures import background_noise, failure_summary, mean_by_region, spurious_activity_rate
from mergecompose.experiments.evaluate import JOINT, greedy_tokens
from mergecompose.experiments.formats import IGNORE_INDEX
from mergecompose.experiments.tokenizer import encode_strings
from mergecompose.studies.skills.spec import END, NO_OWNER, joint_target, region_labels


def analysed_splits(data) -> list:
    """`joint` and the `length_<L>` splits, in order of length."""
    sets = [data.test[JOINT]] + [s for name, s in data.test.items() if name.startswith("length_")]
    return sorted(sets, key=lambda eval_set: eval_set.length)


def _targets_and_regions(spec, eval_set, tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets + EOS `(B, L+1)`, their lengths `(B,)`, regions `(B, L+1)` and owners `(B, L+1)`."""
    targets = [joint_target(source, spec) for source in eval_set.sources]
    if [t.text for t in targets] != list(eval_set.targets):
        raise ValueError(f"eval set {eval_set.name!r} does not hold joint targets")
    ids = encode_strings(tokenizer, [t.text for t in targets])
    width = max(len(row) for row in ids) + 1
    target_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    regions = torch.full((len(ids), width), END, dtype=torch.long)
    owners = torch.full((len(ids), width), NO_OWNER, dtype=torch.long)
    for row, (tokens, target) in enumerate(zip(ids, targets)):
        target_ids[row, : len(tokens) + 1] = torch.tensor([*tokens, tokenizer.eos_token_id])
        regions[row, : len(tokens) + 1] = torch.tensor(region_labels(target))
        owners[row, : len(tokens)] = torch.tensor(target.owners)
    lengths = torch.tensor([len(row) for row in ids])
    return target_ids, lengths, regions, owners


def system_failures(system, spec, eval_set, fmt, tokenizer, batch_size: int, margin: int) -> dict:
    """`failure_summary` of `system`'s real greedy outputs on `eval_set` (joint targets)."""
    targets, lengths, regions, owners = _targets_and_regions(spec, eval_set, tokenizer)
    sources = encode_strings(tokenizer, eval_set.sources)
    generated = greedy_tokens(system, sources, fmt, tokenizer, int(lengths.max()) + margin, batch_size)
    return failure_summary(
        generated, targets, lengths, regions, tokenizer.eos_token_id, tokenizer.pad_token_id, owners, spec.joint
    )


def activity_examples(activity: torch.Tensor, owners: torch.Tensor, targets: list[str], examples: int) -> list[dict]:
    """The per-position activity of the first `examples` sequences, for
    `mergecompose.analysis.overlap_report.plot_activity_heatmap`.

    Args:
        activity: `(k, B, W)` KL(p_i ‖ p_b) per expert and output step; row b's steps are its
            target's characters, then EOS, then padding up to W (cut off here).
        owners: `(B, W)` the owning expert per step or -1.
        targets: the B target strings.
    Returns:
        One dict per sequence: `activity` (k lists of L+1 floats), `next_tokens` (the target
        characters, then "<eos>"), and `intervals`: expert i's own segment (markers included) as
        `[start, stop)` output steps, or None where it owns none.
    """
    rows = []
    for index in range(min(examples, activity.shape[1])):
        intervals = []
        for expert in range(activity.shape[0]):
            steps = (owners[index] == expert).nonzero().flatten()
            intervals.append([int(steps.min()), int(steps.max()) + 1] if len(steps) else None)
        rows.append(
            {
                "sequence": index,
                "activity": activity[:, index, : len(targets[index]) + 1].tolist(),
                "next_tokens": [*targets[index], "<eos>"],
                "intervals": intervals,
            }
        )
    return rows


def _pad_steps(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad the last (step) dimension to `width` with zeros (False for bool)."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


@torch.no_grad()
def composition_noise(
    composed, spec, eval_set, fmt, tokenizer, batch_size: int, epsilon: float, heatmap_examples: int = 3
) -> dict:
    """Teacher-forced background noise of a `ComposedLM` on `eval_set`'s joint targets.

    Returns per-region means of `inactive_activity`, `eos_noise`, `oracle_shift` and `oracle_flip` (see
    `mergecompose.analysis.failures.background_noise`), the co-activation rate and the spurious-activity
    rate at `epsilon`, the mean activity of each expert inside its own segments, and `heatmap`:
    the per-position activity of the first `heatmap_examples` sequences (`activity_examples`).
    """
    sums: dict[str, list[torch.Tensor]] = {
        "inactive_activity": [],
        "eos_noise": [],
        "oracle_shift": [],
        "oracle_flip": [],
    }
    # Per batch, padded to the longest target + EOS of the set (W steps): targets may differ in
    # length (a skill such as `double` changes it); `valid` marks the real steps.
    all_valid, activities = [], []  # (B, W), (k, B, W)
    _, lengths_all, regions_all, owners = _targets_and_regions(spec, eval_set, tokenizer)
    width = regions_all.shape[1]
    sources = encode_strings(tokenizer, eval_set.sources)
    target_ids = encode_strings(tokenizer, list(eval_set.targets))
    for start in range(0, len(sources), batch_size):
        stop = start + batch_size
        batch = fmt.batch(sources[start:stop], target_ids[start:stop])
        components = composed.component_logprobs(
            batch.input_ids, batch.attention_mask, batch.position_ids
        )  # (k+1, B, T, V)
        labelled = batch.labels != IGNORE_INDEX  # (B, T): the targets, then EOS
        first = labelled.int().argmax(-1)  # (B,) the first labelled column
        if not (first == first[0]).all():
            raise ValueError(f"eval set {eval_set.name!r} mixes source lengths; the noise is measured per length")
        counts = labelled.sum(-1)  # (B,) target length + 1
        steps = int(counts.max())
        picked = components[:, :, int(first[0]) : int(first[0]) + steps]  # (k+1, B, steps, V)
        valid = torch.arange(steps)[None] < counts[:, None]  # (B, steps)
        noise = background_noise(picked, owners[start:stop, :steps], tokenizer.eos_token_id)
        for key in sums:
            sums[key].append(_pad_steps(noise[key], width))
        activities.append(_pad_steps(noise["activity"], width))
        all_valid.append(_pad_steps(valid, width))
    valid = torch.cat(all_valid)  # (N, W)
    regions = regions_all.masked_fill(~valid, -1)  # padding belongs to no region
    activity = torch.cat(activities, dim=1)  # (k, N, W)
    if not torch.equal(valid.sum(-1), lengths_all + 1):
        raise ValueError(f"eval set {eval_set.name!r}: the labelled steps do not match the joint targets")
    result = {key: mean_by_region(torch.cat(values), regions) for key, values in sums.items()}
    result["coactivation_rate"] = coactivation_rate(activity, epsilon, valid)
    result["spurious_activity_rate"] = spurious_activity_rate(activity, owners, epsilon, valid)
    own = {}
    for index, name in enumerate(composed.expert_names):
        mask = owners == index
        own[name] = float(activity[index][mask].mean()) if mask.any() else None
    result["own_segment_activity"] = own
    result["epsilon"] = epsilon
    result["experts"] = list(composed.expert_names)
    result["heatmap"] = activity_examples(activity, owners, list(eval_set.targets), heatmap_examples)
    return result


def failure_section(context) -> dict:
    """`results["skills_failures"]`: failure summaries per combined system and split, and the noise."""
    config, components, data = context.config, context.components, context.data
    spec = config.task
    fmt, tokenizer = components.format, components.tokenizer
    batch_size = config.evaluation.batch_size
    splits = analysed_splits(data)
    systems = {}
    for name, system in context.systems.items():
        if name.startswith(("compose", "merge:")):
            systems[name] = {
                eval_set.name: system_failures(system, spec, eval_set, fmt, tokenizer, batch_size, spec.failure_margin)
                for eval_set in splits
            }
    noise = {}
    plain = context.systems.get("compose")
    if plain is not None:
        noise = {
            eval_set.name: composition_noise(
                plain.composed, spec, eval_set, fmt, tokenizer, batch_size, spec.activity_epsilon
            )
            for eval_set in splits
        }
    return {"num_experts": spec.num_experts, "systems": systems, "noise": noise}
