"""One merge-grid selection: score the merge at every grid point (each one a `System`), keep the best.

Shared by `mergecompose compare` (in-memory merges, validation exact match), a `type: lm_eval` compare
(mergekit merges on disk, an lm-eval selection task) and the sweeps. The best is the first of the
highest scores (of the lowest, for a metric where lower is better), in grid order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mergecompose.experiments.scored_systems import System
from mergecompose.merging import merge


def merged_model(
    base: torch.nn.Module, experts: Sequence[torch.nn.Module], method: str, params: Mapping, seed: int
) -> torch.nn.Module:
    """A copy of `base` holding `merge(method, base, experts, seed=seed, **params)`; the inputs are not modified."""
    model = copy.deepcopy(base)
    model.load_state_dict(merge(method, base, list(experts), seed=seed, progress=False, **params))
    return model.eval()


def search_merges(
    grids: Mapping[str, Sequence[Mapping]],
    merge_system: Callable[[str, dict], System],
    score: Callable[[System], float | Mapping],
    progress: bool = True,
) -> list[dict]:
    """`[{"method", "params", "score", ...}, ...]` for every (method, grid point) of `grids`, in order.

    `merge_system(method, params)` is the merge at that grid point; `score(system)` evaluates it,
    loading it (memory then holds one merge at a time): a float, or a mapping with the float under
    "score" and whatever else the record keeps.
    """
    jobs = [(method, dict(params)) for method, points in grids.items() for params in points]
    records = []
    for method, params in tqdm(jobs, desc="merges (validation)", disable=not progress, leave=False):
        value = score(merge_system(method, params))
        details = dict(value) if isinstance(value, Mapping) else {"score": value}
        records.append({"method": method, "params": params, **details})
    return records


def _better(record: dict, best: dict, higher_is_better: bool) -> bool:
    return record["score"] > best["score"] if higher_is_better else record["score"] < best["score"]


def best_record(records: Sequence[dict], higher_is_better: bool = True) -> dict:
    """The first record with the best score."""
    if not records:
        raise ValueError("`records` is empty; a merge grid needs at least one point")
    best = records[0]
    for record in records[1:]:
        if _better(record, best, higher_is_better):
            best = record
    return best


def best_per_method(records: Sequence[dict], higher_is_better: bool = True) -> dict[str, dict]:
    """For each method, its first record with the best score."""
    best: dict[str, dict] = {}
    for record in records:
        if record["method"] not in best or _better(record, best[record["method"]], higher_is_better):
            best[record["method"]] = record
    return best
