"""Train or load the base and the experts, cached under the run folder by a hash of what made them.

    DIR/checkpoints/base-<hash>/            transformers folder (safetensors, config, tokenizer)
    DIR/checkpoints/expert-ab-<hash>/       full fine-tune (or, with `init: scratch`, trained alone)
    DIR/checkpoints/lora-ab-<hash>/         peft LoRA adapter folder for the base

Each hash covers only the settings that shape that checkpoint (an expert's includes its base's
hash), so changing the evaluation or the merges retrains nothing, and changing the expert
recipe keeps the base. A folder is written into a temporary folder beside it, `manifest.json`
(every file's size) last, and renamed into place; before it is reused, its files are checked
against the manifest, and one that fails (a truncated or missing file) is trained again with a
warning that names the file. Runs that share a checkpoints folder (`skills-sweep --checkpoints`)
run side by side: an entry is locked shared while it is checked or loaded and exclusively while
it is trained, and a run that waited for another's training reuses its result.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from mergecompose.core.io import MANIFEST_NAME, atomic_output_dir, manifest_problem, safetensors_problem, write_manifest
from mergecompose.core.locks import entry_lock
from mergecompose.core.training import train_model
from mergecompose.experiments.compare_config import CompareConfig, TrainingSettings, fingerprint
from mergecompose.experiments.formats import SequenceFormat
from mergecompose.experiments.models import build_model, lora_config
from mergecompose.experiments.tokenizer import build_tokenizer

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
        return load_checkpoint(self.base_dir).eval()

    def load_expert(self, name: str) -> PreTrainedModel:
        expert = load_checkpoint(self.experts[name]).eval()
        if self.expert_variant is None:
            return expert
        return self.expert_variant(self.load_base(), expert, name)

    def load_adapter(self, name: str) -> PeftModel:
        """The LoRA expert `name` on its own fresh copy of the base (unmerged, as peft runs it)."""
        base = self.load_base()
        with entry_lock(self.adapters[name], exclusive=False):
            return PeftModel.from_pretrained(base, str(self.adapters[name])).eval()


def load_checkpoint(folder: Path) -> PreTrainedModel:
    """The model of a cached checkpoint, read under the entry's shared lock (no run replaces it meanwhile)."""
    with entry_lock(folder, exclusive=False):
        return AutoModelForCausalLM.from_pretrained(folder)


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
            config.model,
            len(tokenizer),
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            derived_seed(config.training.seed, *labels),
        )

    def strings(skill: str | None, settings: TrainingSettings, *labels: str):
        """Training batches for the base (`skill` None) or an expert, from the task type."""
        return task.training_strings(
            skill, tokenizer, fmt, settings, derived_seed(config.training.seed, "data", *labels)
        )

    notice = (lambda line: print(line, file=sys.stderr)) if progress else None

    def checkpoint(label: str, recipe: dict, make: Callable[[Path], dict]) -> Path:
        digest = fingerprint(recipe)
        target = root / f"{label}-{digest}"
        with entry_lock(target, exclusive=False, notice=notice):
            problem = entry_problem(target)
        cached = problem is None
        if not cached:
            with entry_lock(target, exclusive=True, notice=notice):
                problem = entry_problem(target)  # another run may have trained it while this one waited
                cached = problem is None
                if not cached:
                    if target.exists():
                        warnings.warn(
                            f"cached checkpoint {target.name} cannot be reused ({problem}); training it again",
                            UserWarning,
                            stacklevel=2,
                        )
                    # overwrite: a damaged folder (a truncated or a missing file) is replaced.
                    with atomic_output_dir(target, overwrite=True) as folder:
                        _finish(folder, recipe, make(folder), tokenizer)
        record = json.loads((target / "training.json").read_text())
        training[label] = {"fingerprint": digest, "cached": cached, "path": str(target), "log": record["log"]}
        return target

    # The base copies: trained from scratch on the identity map.
    base_recipe = {"component": "base", **shared, "training": config.training.base.model_dump(mode="json")}

    def train_base(folder: Path) -> dict:
        model = new_model("base")
        log = train_model(
            model,
            strings(None, config.training.base, "base"),
            config.training.base,
            config.training.base.total_steps,
            description="base",
            progress=progress,
        )
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
            model = load_checkpoint(base_dir) if plan.init == "base" else new_model("expert", name)
            log = train_model(
                model,
                strings(name, plan.full, "expert", name),
                plan.full,
                plan.full.total_steps,
                description=f"expert {name}",
                progress=progress,
            )
            model.save_pretrained(folder)
            return log.to_dict()

        experts[name] = checkpoint(f"expert-{name}", recipe, train_expert)

        lora = plan.lora_for(name)
        if lora is not None:
            # "init": the adapter's initial weights are drawn from a seed of its own (`new_adapter`); adapters
            # cached before, drawn from whatever state torch's global generator was in, are not reused.
            lora_recipe = {
                **recipe,
                "component": "lora",
                "base": base_recipe,
                "training": lora.model_dump(mode="json"),
                "init": "derived_seed",
            }

            def train_adapter(folder: Path, name=name, lora=lora) -> dict:
                base = load_checkpoint(base_dir)
                init_seed = derived_seed(config.training.seed, "lora-init", name)
                peft_model = new_adapter(base, lora_config(lora, config.model.architecture), init_seed)
                settings = lora.training
                log = train_model(
                    peft_model,
                    strings(name, settings, "lora", name),
                    settings,
                    settings.total_steps,
                    description=f"lora {name}",
                    progress=progress,
                )
                peft_model.save_pretrained(str(folder))
                return log.to_dict()

            adapters[name] = checkpoint(f"lora-{name}", lora_recipe, train_adapter)

    return Components(tokenizer, fmt, base_dir, experts, adapters, training, task.expert_variant)


def new_adapter(base: PreTrainedModel, lora: LoraConfig, seed: int) -> PeftModel:
    """`base` with a new LoRA adapter whose initial weights depend on `seed` alone.

    peft draws them from torch's global generator, whose state depends on whatever the process ran
    before (a sweep evaluates k = 2 before it trains k = 4's adapters): the draw runs on a fork of
    it, seeded, so the global state is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(base, lora)


def _finish(folder: Path, recipe: dict, log: dict, tokenizer) -> None:
    tokenizer.save_pretrained(str(folder))
    (folder / "training.json").write_text(json.dumps({"recipe": recipe, "log": log}, indent=1))
    write_manifest(folder)  # last: it covers every file above


def entry_problem(folder: Path) -> str | None:
    """Why the cached checkpoint `folder` cannot be reused (one line naming the file), or None if it can.

    An entry needs its `training.json` and every file as large as its manifest says. An entry of
    a version before manifests has its safetensors files checked against their own headers.
    """
    if not folder.is_dir():
        return f"{folder} does not exist"
    if not (folder / "training.json").is_file():
        return f"{folder / 'training.json'} is missing"
    if (folder / MANIFEST_NAME).exists():
        return manifest_problem(folder)
    return next(filter(None, map(safetensors_problem, sorted(folder.glob("*.safetensors")))), None)
