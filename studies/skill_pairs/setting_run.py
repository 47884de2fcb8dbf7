"""One real setting, evaluated: the base, two skill experts, their merges and compositions on the joint items.

A setting is two skills (`joint_items(first, second, …)`) and their two LoRA experts. Its systems, all from one
copy of the base in memory:

* `base`, and each expert alone (`expert:<skill>`, the adapter merged into a copy of the base);
* merges (`merge:<method>@<point>`): `mergecompose.merging.merge` of the experts' dense ΔW
  (`TaskVector.from_lora`), at each point of `merges`' grids;
* compositions (`compose@<weights>` and `compose+<remedy>`): `ComposedLM.from_adapters` at each weight point,
  and with each remedy at weights 1.

Greedy answers of at most `max_new_tokens` tokens (chat template, `math_code.chat_data.generation_inputs`),
scored leniently (`skill_scoring.score_item`: right when both parts are). The best merge and the best
composition are chosen on the validation items (the first of the highest accuracies, in grid order); then
the base, both experts and the two chosen systems answer the test items, and `paired_outcome` labels the
setting. Every (system, split) answer set is a cell, cached as JSON in `folder/cells/`, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from peft import PeftModel
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergecompose.analysis.paired_outcome import paired_outcome
from mergecompose.composition import ComposedLM
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.io import atomic_write_text
from mergecompose.merging import TaskVector, merge
from mergecompose.studies.math_code.chat_data import end_of_turn_id, generation_inputs
from mergecompose.studies.skill_pairs.skill_data import SkillItem
from mergecompose.studies.skill_pairs.skill_scoring import score_item

Answerer = Callable[[list[str]], list[str]]


def model_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers of a plain causal LM (or a `ComposedLM`) to `prompts`, in batches, decoded."""
    stop = end_of_turn_id(tokenizer)
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        inputs = generation_inputs(tokenizer, prompts[start : start + batch_size])  # (B, T) each
        with torch.no_grad():
            if isinstance(model, ComposedLM):
                out = model.generate(
                    inputs["input_ids"],
                    inputs["attention_mask"],
                    max_new_tokens=max_new_tokens,
                    eos_token_id=stop,
                    pad_token_id=stop,
                )
            else:
                out = model.generate(
                    **inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=stop, pad_token_id=stop
                )
        new = out[:, inputs["input_ids"].shape[1] :]  # (B, n)
        answers += tokenizer.batch_decode(new, skip_special_tokens=True)
    return answers


class SettingRun:
    """The systems of one setting over a shared base, and their cached cells (see the module docstring)."""

    def __init__(
        self,
        base: str | os.PathLike,
        experts: Mapping[str, str | os.PathLike],
        folder: str | os.PathLike,
        max_new_tokens: int = 48,
        batch_size: int = 32,
        progress: bool = True,
    ):
        if not experts:
            raise ValueError("`experts` must map at least one skill to its adapter, got none")
        self.base_path, self.experts = str(base), {name: str(path) for name, path in experts.items()}
        self.folder = Path(folder)
        self.max_new_tokens, self.batch_size, self.progress = max_new_tokens, batch_size, progress
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_path)
        self.base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype=torch.float32).eval()
        self._task_vectors: list[TaskVector] | None = None

    # --- the systems -------------------------------------------------------------------------

    def expert_model(self, skill: str):
        return PeftModel.from_pretrained(copy.deepcopy(self.base), self.experts[skill]).merge_and_unload().eval()

    def task_vectors(self) -> list[TaskVector]:
        """Each expert's dense ΔW (`TaskVector.from_lora`), computed once."""
        if self._task_vectors is None:
            self._task_vectors = [TaskVector.from_lora(self.base, path) for path in self.experts.values()]
        return self._task_vectors

    def merged_model(self, method: str, params: Mapping):
        model = copy.deepcopy(self.base)
        model.load_state_dict(merge(method, self.base, self.task_vectors(), progress=False, **params))
        return model.eval()

    def composed(self, weights: Sequence[float], remedy: RemedySettings | None = None) -> ComposedLM:
        remedies = remedy.build(end_of_turn_id(self.tokenizer)) if remedy is not None else ()
        # On the base itself: `close()` (after the cell) gives it back bit for bit.
        return ComposedLM.from_adapters(
            self.base, self.experts, list(weights), tokenizer=self.tokenizer, remedies=remedies
        )

    # --- the cells -----------------------------------------------------------------------------

    def cell(self, system: str, split: str, items: Sequence[SkillItem], build: Callable[[], object]) -> dict:
        """The answers of `system` (built by `build` only when the cell is not cached) to `items`, scored."""
        path = self.folder / "cells" / f"{system}--{split}.json"
        prompts = [item.prompt for item in items]
        if path.is_file():
            cached = json.loads(path.read_text(encoding="utf-8"))
            if cached["prompts"] == prompts:
                return cached
        started = time.perf_counter()
        model = build()
        try:
            outputs = model_answers(model, self.tokenizer, prompts, self.max_new_tokens, self.batch_size)
        finally:
            if isinstance(model, ComposedLM):
                model.close()
        seconds = round(time.perf_counter() - started, 1)
        scores = [score_item(item, output) for item, output in zip(items, outputs)]
        record = {
            "system": system,
            "split": split,
            "prompts": prompts,
            "outputs": outputs,
            "right": [score.lenient for score in scores],
            "strict": [score.strict for score in scores],
            "parts": {skill: [score.parts[skill].lenient for score in scores] for skill in scores[0].parts},
        }
        record["accuracy"] = sum(record["right"]) / len(items)
        record["strict_accuracy"] = sum(record["strict"]) / len(items)
        record["seconds"] = seconds  # building the system and answering, when the cell was made
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record) + "\n")
        return record

    def candidates(
        self, merges: Mapping[str, Sequence[Mapping]], weights: Sequence[float], remedies: Mapping[str, RemedySettings]
    ) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
        """The merge and composition systems to choose from, by name, each with its builder."""
        merge_systems = {
            f"merge:{method}@{_point(params)}": (lambda m=method, p=params: self.merged_model(m, p))
            for method, grid in merges.items()
            for params in grid
        }
        compose_systems: dict[str, Callable[[], object]] = {
            f"compose@{weight:g}": (lambda w=weight: self.composed([w, w])) for weight in weights
        }
        for name, remedy in remedies.items():
            compose_systems[f"compose+{name}"] = lambda r=remedy: self.composed([1.0, 1.0], r)
        return merge_systems, compose_systems

    def run(
        self,
        validation: Sequence[SkillItem],
        test: Sequence[SkillItem],
        merges: Mapping[str, Sequence[Mapping]],
        weights: Sequence[float],
        remedies: Mapping[str, RemedySettings],
    ) -> dict:
        """Choose the best merge and composition on `validation`, score the systems on `test`, label the setting."""
        if len(self.experts) != 2:
            raise ValueError(f"a setting has two experts, got {list(self.experts)}")
        merge_systems, compose_systems = self.candidates(merges, weights, remedies)
        chosen, seconds = {}, []
        bar = tqdm(total=len(merge_systems) + len(compose_systems) + 5, disable=not self.progress, desc="cells")
        for kind, systems in (("merge", merge_systems), ("compose", compose_systems)):
            scores = {}
            for name, build in systems.items():
                cell = self.cell(name, "validation", validation, build)
                scores[name] = cell["accuracy"]
                seconds.append(cell.get("seconds"))
                bar.update()
            best = max(scores, key=lambda name: scores[name])  # the first of the highest, in grid order
            chosen[kind] = {"system": best, "validation": scores}
        experts = list(self.experts)
        test_systems = {
            "base": lambda: self.base,
            **{f"expert:{skill}": (lambda s=skill: self.expert_model(s)) for skill in experts},
            chosen["merge"]["system"]: merge_systems[chosen["merge"]["system"]],
            chosen["compose"]["system"]: compose_systems[chosen["compose"]["system"]],
        }
        cells = {}
        for name, build in test_systems.items():
            cells[name] = self.cell(name, "test", test, build)
            seconds.append(cells[name].get("seconds"))
            bar.update()
        bar.close()
        outcome = paired_outcome(cells[chosen["merge"]["system"]]["right"], cells[chosen["compose"]["system"]]["right"])
        summary = {name: {key: cell[key] for key in ("accuracy", "strict_accuracy")} for name, cell in cells.items()}
        for name, cell in cells.items():
            summary[name]["parts"] = {skill: sum(rights) / len(rights) for skill, rights in cell["parts"].items()}
        # The time its cells took when they were made (None where a cell was made before cells kept it).
        cell_seconds = None if None in seconds else round(sum(seconds), 1)
        return {"chosen": chosen, "test": summary, "outcome": outcome.to_dict(), "cell_seconds": cell_seconds}


def _point(params: Mapping) -> str:
    return ",".join(
        f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}" for key, value in params.items()
    )
