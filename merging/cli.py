"""`mergecompose merge` (mergekit on disk) and `mergecompose task-vector` (norms and cosines)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_commands(subparsers) -> None:
    merge = subparsers.add_parser(
        "merge", help="merge checkpoints on disk through mergekit (mergekit YAML unchanged, or our typed config)"
    )
    merge.add_argument("config", help="a mergekit YAML file (merge_method: ...) or ours (method: ...)")
    merge.add_argument("out_dir", help="output folder, written atomically")
    merge.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    merge.set_defaults(func=run_merge)

    task_vector = subparsers.add_parser(
        "task-vector", help="norm, per-layer norms and cosines of task vectors θ_ft − θ_base"
    )
    task_vector.add_argument("base", help="base checkpoint folder (safetensors)")
    task_vector.add_argument("finetuned", nargs="+", help="fine-tuned checkpoint folders or LoRA adapter folders")
    task_vector.add_argument("--json", dest="json_path", help="also write the figures to this JSON file")
    task_vector.set_defaults(func=run_task_vector)


def run_merge(args) -> int:
    from safetensors import safe_open

    from merging.checkpoints import load_merge_config, merge_checkpoints

    try:
        mergekit_config, _ = load_merge_config(args.config)
        out_dir = merge_checkpoints(args.config, args.out_dir, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"mergekit `{mergekit_config['merge_method']}` merge written to {out_dir}")
    print(f"{'file':<32} {'bytes':>12}  contents")
    for path in sorted(out_dir.iterdir()):
        contents = ""
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
                dtypes = sorted({str(handle.get_slice(name).get_dtype()) for name in names})
            contents = f"{len(names)} tensors, {', '.join(dtypes)}"
        print(f"{path.name:<32} {path.stat().st_size:>12}  {contents}")
    return 0


def run_task_vector(args) -> int:
    from merging.task_vector import TaskVector

    labels = _labels(args.finetuned)
    task_vectors = {}
    base_model = None
    try:
        for label, path in zip(labels, args.finetuned):
            if (Path(path) / "adapter_config.json").exists():
                if base_model is None:
                    from transformers import AutoModelForCausalLM

                    base_model = AutoModelForCausalLM.from_pretrained(args.base)
                task_vectors[label] = TaskVector.from_lora(base_model, path)
            else:
                task_vectors[label] = TaskVector.from_checkpoints(args.base, path)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    norms = {label: task_vector.norm() for label, task_vector in task_vectors.items()}
    layer_norms = {label: task_vector.layer_norms() for label, task_vector in task_vectors.items()}
    cosines = {
        first: {second: _cosine(task_vectors[first], task_vectors[second]) for second in labels} for first in labels
    }
    width = max(24, *(len(label) + 2 for label in labels))
    print(f"{'task vector':<{width}} {'norm':>12} {'tensors':>8} {'parameters':>12}")
    for label, task_vector in task_vectors.items():
        count = sum(tensor.numel() for tensor in task_vector.tensors.values())
        print(f"{label:<{width}} {norms[label]:>12.5g} {len(task_vector.tensors):>8} {count:>12}")

    groups = list(dict.fromkeys(group for norms_of in layer_norms.values() for group in norms_of))
    group_width = max(24, *(len(group) + 2 for group in groups))
    print(f"\nper-layer norms\n{'layer':<{group_width}}" + "".join(f" {label:>12}" for label in labels))
    for group in groups:
        row = "".join(f" {layer_norms[label].get(group, 0.0):>12.5g}" for label in labels)
        print(f"{group:<{group_width}}{row}")

    if len(labels) > 1:
        print(f"\ncosine\n{'':<{width}}" + "".join(f" {label:>12}" for label in labels))
        for first in labels:
            row = "".join(f" {_format(cosines[first][second]):>12}" for second in labels)
            print(f"{first:<{width}}{row}")

    if args.json_path:
        record = {
            "base": args.base,
            "task_vectors": {
                label: {"path": path, "norm": norms[label], "layer_norms": layer_norms[label]}
                for label, path in zip(labels, args.finetuned)
            },
            "cosine": cosines,
        }
        Path(args.json_path).write_text(json.dumps(record, indent=2))
        print(f"\nwrote {args.json_path}")
    return 0


def _labels(paths: list[str]) -> list[str]:
    """Folder names, or the full paths where two folders share a name."""
    names = [Path(path).name or path for path in paths]
    return names if len(set(names)) == len(names) else list(paths)


def _cosine(first, second) -> float | None:
    try:
        return first.cosine(second)
    except ValueError:  # a zero task vector
        return None


def _format(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
