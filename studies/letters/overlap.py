"""The overlap diagnostics on the letter-replacement task (`tasks/`), per pair of skills.

`letters_overlap_section` is a results section for `mergecompose compare`
(`mergecompose.experiments.compare.run_compare(..., sections={"overlap": letters_overlap_section})`): for every
pair of trained skills it measures, on held-out strings where both skills are active,

* teacher-forced: the pair's joint target as the prefix (where the two maps conflict, e.g.
  `ab` + `ac`, the joint target is undefined and the first skill's letter is used there);
* on the composed model's own greedy rollouts (seq2seq only);

with the task-arithmetic merge at λ = 1 for the merge-vs-compose gap, and the task vectors for
the parameter-space measures.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from itertools import combinations

import numpy as np
import torch

from mergecompose.analysis.measure import measure_overlap, rollout_batches
from mergecompose.analysis.streaming import OverlapSettings
from mergecompose.composition import ComposedLM
from mergecompose.experiments.formats import IGNORE_INDEX
from mergecompose.experiments.tokenizer import encode_strings
from mergecompose.experiments.training_strings import is_held_out
from mergecompose.merging import TaskVector, merge
from mergecompose.studies.letters.task import apply_replacements, sample_strings


def pair_replacements(
    replace_a: Mapping[str, str], replace_b: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, set[str]]]:
    """The pair's joint map, and for each letter both skills send to different letters, the allowed set.

    Returns `(prefix_map, allowed)`: `prefix_map` is the union of the two maps, resolved to the
    first skill's letter where they conflict; `allowed[c]` is `{replace_a[c], replace_b[c]}` for
    every conflicting letter c (the joint target is undefined there, so either letter counts).
    """
    prefix_map = {**replace_b, **replace_a}
    allowed = {c: {replace_a[c], replace_b[c]} for c in replace_a if c in replace_b and replace_a[c] != replace_b[c]}
    return prefix_map, allowed


def pair_strings(task, name_a: str, name_b: str, length: int, count: int, seed: int, exclude=frozenset()) -> list[str]:
    """`count` held-out strings of `length` in which both skills are active (seeded)."""
    skill_a, skill_b = task.skills[name_a], task.skills[name_b]
    rng = np.random.default_rng(seed)
    keep = lambda text: is_held_out(text) and skill_a.is_active(text) and skill_b.is_active(text)  # noqa: E731
    return sample_strings(task.alphabet, length, count, rng, keep=keep, exclude=set(exclude))


def teacher_forced_batches(
    fmt, tokenizer, sources: Sequence[str], targets: Sequence[str], batch_size: int
) -> list[dict]:
    """`measure_overlap` batches from the task's own format; the measured positions are the scored ones."""
    source_ids, target_ids = encode_strings(tokenizer, sources), encode_strings(tokenizer, targets)
    batches = []
    for start in range(0, len(source_ids), batch_size):
        batch = fmt.batch(source_ids[start : start + batch_size], target_ids[start : start + batch_size])
        batches.append(
            {
                "input_ids": batch.input_ids,
                "attention_mask": batch.attention_mask,
                "position_ids": batch.position_ids,
                "measure_mask": batch.labels != IGNORE_INDEX,
            }
        )
    return batches


def prompt_batches(fmt, tokenizer, sources: Sequence[str], batch_size: int, max_new_tokens: int) -> list[dict]:
    """Left-padded seq2seq prompts with the task's prompt and generated positions."""
    source_ids = encode_strings(tokenizer, sources)
    batches = []
    for start in range(0, len(source_ids), batch_size):
        prompt = fmt.prompt(source_ids[start : start + batch_size], max_new_tokens)
        batches.append(
            {
                "input_ids": prompt.input_ids,
                "attention_mask": prompt.attention_mask,
                "position_ids": prompt.position_ids,
                "generated_position_ids": prompt.generated_position_ids,
            }
        )
    return batches


def measure_letter_pair(
    base,
    experts: Mapping[str, torch.nn.Module],
    replacements: Mapping[str, Mapping[str, str]],
    fmt,
    tokenizer,
    sources: Sequence[str],
    settings: OverlapSettings | None = None,
    batch_size: int = 128,
    rollouts: bool = True,
) -> dict:
    """The overlap diagnostics of one pair of letter experts (two entries in `experts`).

    Returns `{"teacher_forced": OverlapReport.summary(), "rollouts": {"composed": ...}, "prefix": ...}`.
    """
    (name_a, model_a), (name_b, model_b) = experts.items()
    composed = ComposedLM(base, [model_a, model_b], names=[name_a, name_b])
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge("task_arithmetic", base, [model_a, model_b], lam=1.0, progress=False))
    task_vectors = {name_a: TaskVector.from_models(base, model_a), name_b: TaskVector.from_models(base, model_b)}
    prefix_map, allowed = pair_replacements(replacements[name_a], replacements[name_b])
    targets = [apply_replacements(text, prefix_map) for text in sources]
    common = dict(merged_model=merged, settings=settings, tokenizer=tokenizer, progress=False)
    teacher_forced = measure_overlap(
        composed,
        teacher_forced_batches(fmt, tokenizer, sources, targets, batch_size),
        task_vectors=task_vectors,
        **common,
    )
    result = {
        "teacher_forced": teacher_forced.summary(),
        "prefix": "joint target" if not allowed else f"joint target, conflicts resolved to `{name_a}`'s letter",
        "conflicting_letters": {c: sorted(v) for c, v in allowed.items()},
        "rollouts": {},
    }
    if rollouts and fmt.formulation == "seq2seq":
        max_new_tokens = max(len(text) for text in sources) + 2
        prompts = prompt_batches(fmt, tokenizer, sources, batch_size, max_new_tokens)
        rolled = rollout_batches(
            composed, prompts, "composed", max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        result["rollouts"]["composed"] = measure_overlap(composed, rolled, **common).summary()
    return result


def letters_overlap_section(
    context, settings: OverlapSettings | None = None, strings_per_pair: int = 200, rollouts: bool = True
) -> dict:
    """A `mergecompose compare` results section: the diagnostics for every pair of trained skills.

    Args:
        context: `mergecompose.experiments.compare.RunContext` (config, trained components, data, systems).
        settings: thresholds and sizes of the diagnostics.
        strings_per_pair: held-out strings (of the main evaluation length, both skills active).

    Returns:
        `{"a+b": measure_letter_pair(...)}` for every pair of skills in the config.
    """
    config, components = context.config, context.components
    task = config.task.letter_task()
    base = components.load_base()
    experts = {name: components.load_expert(name) for name in config.task.skills}
    result = {}
    for index, (name_a, name_b) in enumerate(combinations(config.task.skills, 2)):
        sources = pair_strings(
            task, name_a, name_b, config.eval_length, strings_per_pair, config.evaluation.seed + 1 + index
        )
        result[f"{name_a}+{name_b}"] = measure_letter_pair(
            base,
            {name_a: experts[name_a], name_b: experts[name_b]},
            config.task.skills,
            components.format,
            components.tokenizer,
            sources,
            settings=settings,
            batch_size=config.evaluation.batch_size,
            rollouts=rollouts,
        )
    return result
