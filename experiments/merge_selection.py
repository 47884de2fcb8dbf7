"""One merge-grid search: build the merge at every grid point, score it, keep the records in grid order."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from mergecompose.merging import merge


def merged_model(
    base: torch.nn.Module, experts: Sequence[torch.nn.Module], method: str, params: Mapping, seed: int
) -> torch.nn.Module:
    """A copy of `base` holding `merge(method, base, experts, seed=seed, **params)`; the inputs are not modified."""
    model = copy.deepcopy(base)
    model.load_state_dict(merge(method, base, list(experts), seed=seed, progress=False, **params))
    return model.eval()


def search_merges(
    base: torch.nn.Module,
    experts: Sequence[torch.nn.Module],
    grids: Mapping[str, Sequence[Mapping]],
    score: Callable[[str, torch.nn.Module], float],
    seed: int,
    progress: bool = True,
) -> list[dict]:
    """`[{"method", "params", "score"}, ...]` for every (method, grid point) of `grids`, in order.

    `score(method, model)` evaluates one merged model (higher is better). Each model is dropped
    after scoring, so memory holds one merge at a time.
    """
    jobs = [(method, dict(params)) for method, points in grids.items() for params in points]
    records = []
    for method, params in tqdm(jobs, desc="merges (validation)", disable=not progress, leave=False):
        value = score(method, merged_model(base, experts, method, params, seed))
        records.append({"method": method, "params": params, "score": value})
    return records


def best_per_method(records: Sequence[dict]) -> dict[str, dict]:
    """For each method, its first record with the highest score."""
    best: dict[str, dict] = {}
    for record in records:
        if record["method"] not in best or record["score"] > best[record["method"]]["score"]:
            best[record["method"]] = record
    return best
