"""Train or load the base and the experts, cached under the run folder by a hash of what made them.

    DIR/checkpoints/base-<hash>/            transformers folder (safetensors, config, tokenizer)
    DIR/checkpoints/expert-ab-<hash>/       full fine-tune (or, with `init: scratch`, trained alone)
    DIR/checkpoints/lora-ab-<hash>/         peft LoRA adapter folder for the base

Each hash covers only the settings that shape that checkpoint (an expert's includes its base's
hash), so changing the evaluation or the merges retrains nothing, and changing the expert
recipe keeps the base. A folder is complete once its `training.json` exists; it is written into
a temporary folder beside it and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from composition.io import atomic_output_dir
from merging import train_model
from tasks.config import CompareConfig, TrainingSettings, fingerprint
from tasks.formats import SequenceFormat
from tasks.models import build_model, lora_config
from tasks.tokenizer import build_tokenizer

# Bump when the meaning of a training setting changes, so that old checkpoints are not reused.
CHECKPOINT_VERSION = 1


def derived_seed(seed: int, *labels: str) -> int:
    """A stable 31-bit seed per component, from the run's seed and the component's name."""
    digest = hashlib.sha256(json.dumps([seed, *labels]).encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def sequence_format(config: CompareConfig, tokenizer) -> SequenceFormat:
    return SequenceFormat(
        formulation=config.task.formulation,
        positions=config.positions.scheme,
        randomize=config.positions.randomize,
        max_position=config.positions.max_position,
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        sep_id=tokenizer.sep_token_id,
    )


@dataclass
class Components:
    """Where the trained base, experts and adapters are, and how each was made."""

    tokenizer: object
    format: SequenceFormat
    base_dir: Path
    experts: dict[str, Path]
    adapters: dict[str, Path]
    training: dict[str, dict] = field(default_factory=dict)  # component -> fingerprint, cached, log
    # (base, expert, name) -> the expert the systems use; the task's `expert_variant` (e.g. noise added).
    expert_variant: Callable | None = None

    def load_base(self) -> PreTrainedModel:
        """A fresh copy of the base (callers may modify it)."""
        return AutoModelForCausalLM.from_pretrained(self.base_dir).eval()

    def load_expert(self, name: str) -> PreTrainedModel:
        expert = AutoModelForCausalLM.from_pretrained(self.experts[name]).eval()
        if self.expert_variant is None:
            return expert
        return self.expert_variant(self.load_base(), expert, name)

    def load_adapter(self, name: str) -> PeftModel:
        """The LoRA expert `name` on its own fresh copy of the base (unmerged, as peft runs it)."""
        return PeftModel.from_pretrained(self.load_base(), str(self.adapters[name])).eval()


def prepare_components(config: CompareConfig, run_dir: Path, progress: bool = True) -> Components:
    """Train whatever is not cached yet under `run_dir/checkpoints`, and return where everything is."""
    tokenizer = build_tokenizer(config.task.alphabet)
    fmt = sequence_format(config, tokenizer)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    task = config.task
    shared = {
        "version": CHECKPOINT_VERSION,
        "formulation": task.formulation,
        "alphabet": task.alphabet,
        "train_lengths": list(task.train_lengths),
        "positions": config.positions.model_dump(mode="json"),
        "model": config.model.model_dump(mode="json"),
        "seed": config.training.seed,
    }
    if task.data_recipe() is not None:
        shared["task"] = task.data_recipe()
    training: dict[str, dict] = {}

    def new_model(*labels: str) -> PreTrainedModel:
        return build_model(
            config.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
            derived_seed(config.training.seed, *labels),
        )

    def strings(skill: str | None, settings: TrainingSettings, *labels: str):
        """Training batches for the base (`skill` None) or an expert, from the task type."""
        return task.training_strings(skill, tokenizer, fmt, settings, derived_seed(config.training.seed, "data", *labels))

    def checkpoint(label: str, recipe: dict, make: Callable[[Path], dict]) -> Path:
        digest = fingerprint(recipe)
        target = root / f"{label}-{digest}"
        cached = (target / "training.json").is_file()
        if not cached:
            # overwrite: an unfinished folder from an interrupted run (no training.json) is replaced.
            with atomic_output_dir(target, overwrite=True) as folder:
                _finish(folder, recipe, make(folder), tokenizer)
        record = json.loads((target / "training.json").read_text())
        training[label] = {"fingerprint": digest, "cached": cached, "path": str(target), "log": record["log"]}
        return target

    # The base copies: trained from scratch on the identity map.
    base_recipe = {"component": "base", **shared, "training": config.training.base.model_dump(mode="json")}

    def train_base(folder: Path) -> dict:
        model = new_model("base")
        log = train_model(model, strings(None, config.training.base, "base"), config.training.base,
                          config.training.base.total_steps, description="base", progress=progress)
        model.save_pretrained(folder)
        return log.to_dict()

    base_dir = checkpoint("base", base_recipe, train_base)

    experts, adapters = {}, {}
    plan = config.training.experts
    for name in task.trained_skills():
        recipe = {
            "component": "expert",
            **shared,
            "skill": name,
            **task.skill_recipe(name),
            "init": plan.init,
            "base": base_recipe if plan.init == "base" else None,
            "training": plan.full.model_dump(mode="json"),
        }

        def train_expert(folder: Path, name=name) -> dict:
            model = AutoModelForCausalLM.from_pretrained(base_dir) if plan.init == "base" else new_model("expert", name)
            log = train_model(model, strings(name, plan.full, "expert", name), plan.full, plan.full.total_steps,
                              description=f"expert {name}", progress=progress)
            model.save_pretrained(folder)
            return log.to_dict()

        experts[name] = checkpoint(f"expert-{name}", recipe, train_expert)

        lora = plan.lora_for(name)
        if lora is not None:
            lora_recipe = {**recipe, "component": "lora", "base": base_recipe, "training": lora.model_dump(mode="json")}

            def train_adapter(folder: Path, name=name, lora=lora) -> dict:
                base = AutoModelForCausalLM.from_pretrained(base_dir)
                peft_model = get_peft_model(base, lora_config(lora, config.model.architecture))
                settings = lora.training
                log = train_model(peft_model, strings(name, settings, "lora", name), settings, settings.total_steps,
                                  description=f"lora {name}", progress=progress)
                peft_model.save_pretrained(str(folder))
                return log.to_dict()

            adapters[name] = checkpoint(f"lora-{name}", lora_recipe, train_adapter)

    return Components(tokenizer, fmt, base_dir, experts, adapters, training, task.expert_variant)


def _finish(folder: Path, recipe: dict, log: dict, tokenizer) -> None:
    tokenizer.save_pretrained(str(folder))
    (folder / "training.json").write_text(json.dumps({"recipe": recipe, "log": log}, indent=1))
