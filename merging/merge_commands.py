"""`mergecompose merge` (mergekit on disk; a user's method, named by import path, in memory) and
`mergecompose task-vector` (norms and cosines)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors import safe_open
from transformers import AutoModelForCausalLM

from mergecompose.core.boundary import check_checkpoint, check_model_or_adapter
from mergecompose.core.cli_common import add_common_flags, declare_paths
from mergecompose.core.io import atomic_output_dir, markdown_table, refuse_existing
from mergecompose.merging.checkpoints import load_merge_config, merge_checkpoints, prepare_merge
from mergecompose.merging.in_memory_checkpoints import merge_in_memory, prepare_in_memory_merge, user_merge_config
from mergecompose.merging.task_vector import TaskVector

_ALLOW_NONFINITE = (
    "accept NaN or inf weights in the inputs (and in the result); by default they are refused, naming the tensor"
)


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    merge = subparsers.add_parser(
        "merge",
        help="merge checkpoints through mergekit (mergekit YAML unchanged, or our typed config), or in memory "
        "with your own method (our typed config, `method: package.module:Name`)",
        description="mergecompose merge CONFIG --out DIR; the older form `merge CONFIG DIR` does the same.",
    )
    merge.add_argument(
        "config", help="a mergekit YAML file (merge_method: ...) or ours (method: NAME or package.module:Name)"
    )
    merge.add_argument("out_dir", nargs="?", metavar="DIR", help=argparse.SUPPRESS)  # the older form of --out
    add_common_flags(merge, out="output folder, written atomically", check=True)
    merge.add_argument("--allow-nonfinite", action="store_true", help=_ALLOW_NONFINITE)
    declare_paths(merge, configs=("config",), outputs=("out", "out_dir"))
    merge.set_defaults(func=run_merge, preflight=preflight_merge)

    task_vector = subparsers.add_parser(
        "task-vector", help="norm, per-layer norms and cosines of task vectors θ_ft − θ_base"
    )
    task_vector.add_argument("base", help="base checkpoint folder (safetensors)")
    task_vector.add_argument("finetuned", nargs="+", help="fine-tuned checkpoint folders or LoRA adapter folders")
    add_common_flags(task_vector, out="also write the figures to DIR/task_vectors.json")
    task_vector.add_argument("--allow-nonfinite", action="store_true", help=_ALLOW_NONFINITE)
    declare_paths(task_vector, inputs=("base", "finetuned"))
    task_vector.set_defaults(func=run_task_vector)


def merge_out_dir(args: argparse.Namespace) -> str:
    """The output folder of `merge`, given as `--out DIR` or, in the older form, as the second positional."""
    if args.out is not None and args.out_dir is not None:
        raise ValueError(
            f"give the output folder once, as `--out DIR` (or the older `merge CONFIG DIR`), got both "
            f"{args.out_dir!r} and `--out` {args.out!r}"
        )
    if args.out is None and args.out_dir is None:
        raise ValueError("the output folder is missing: give `--out DIR` (or the older `merge CONFIG DIR`)")
    return args.out if args.out is not None else args.out_dir


def preflight_merge(args: argparse.Namespace) -> None:
    """Every check of the merge before any weights load: `prepare_in_memory_merge` for our config naming a user's
    method by import path, `mergecompose.merging.checkpoints.prepare_merge` (mergekit) otherwise."""
    if user_merge_config(args.config) is not None:
        prepare_in_memory_merge(args.config, merge_out_dir(args), args.overwrite, allow_nonfinite=args.allow_nonfinite)
        return
    options = {"quiet": args.quiet}
    prepare_merge(
        args.config, merge_out_dir(args), args.overwrite, options=options, allow_nonfinite=args.allow_nonfinite
    )


def run_merge(args: argparse.Namespace) -> int:
    out = merge_out_dir(args)
    user_config = user_merge_config(args.config)
    if user_config is not None:
        out_dir = merge_in_memory(
            user_config, out, overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite, progress=not args.quiet
        )
        print(f"in-memory `{user_config.method}` merge written to {out_dir}")
    else:
        mergekit_config, _ = load_merge_config(args.config)
        out_dir = merge_checkpoints(
            args.config,
            out,
            overwrite=args.overwrite,
            options={"quiet": args.quiet},
            allow_nonfinite=args.allow_nonfinite,
        )
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


def run_task_vector(args: argparse.Namespace) -> int:
    if args.out is not None:
        refuse_existing(args.out, args.overwrite)  # before the work, not after
    labels = _labels(args.finetuned)
    base = check_checkpoint(
        args.base, "base", adapter_hint="give the adapter's base as `base` and the adapter after it"
    )
    kinds = [check_model_or_adapter(path, f"finetuned[{index}]") for index, path in enumerate(args.finetuned)]
    task_vectors = {}
    base_model = None
    for label, path, kind in zip(labels, args.finetuned, kinds):
        if kind == "adapter":
            if base_model is None:
                base_model = AutoModelForCausalLM.from_pretrained(base)
            task_vectors[label] = TaskVector.from_lora(base_model, path, allow_nonfinite=args.allow_nonfinite)
        else:
            task_vectors[label] = TaskVector.from_checkpoints(base, path, allow_nonfinite=args.allow_nonfinite)

    norms = {label: task_vector.norm() for label, task_vector in task_vectors.items()}
    layer_norms = {label: task_vector.layer_norms() for label, task_vector in task_vectors.items()}
    cosines = {
        first: {second: _cosine(task_vectors[first], task_vectors[second]) for second in labels} for first in labels
    }
    rows = [
        [label, norms[label], len(tv.tensors), sum(t.numel() for t in tv.tensors.values())]
        for label, tv in task_vectors.items()
    ]
    print(markdown_table(["task vector", "norm", "tensors", "parameters"], rows, cell=_format, pad=True))
    groups = list(dict.fromkeys(group for norms_of in layer_norms.values() for group in norms_of))
    rows = [[group, *[layer_norms[label].get(group, 0.0) for label in labels]] for group in groups]
    print("\nper-layer norms\n" + markdown_table(["layer", *labels], rows, cell=_format, pad=True))
    if len(labels) > 1:
        rows = [[first, *[cosines[first][second] for second in labels]] for first in labels]
        print("\ncosine\n" + markdown_table(["", *labels], rows, cell=_format, pad=True))

    if args.out is not None:
        record = {
            "base": args.base,
            "task_vectors": {
                label: {"path": path, "norm": norms[label], "layer_norms": layer_norms[label]}
                for label, path in zip(labels, args.finetuned)
            },
            "cosine": cosines,
        }
        with atomic_output_dir(args.out, args.overwrite) as folder:
            (folder / "task_vectors.json").write_text(json.dumps(record, indent=2))
        if not args.quiet:
            print(f"\nwrote {Path(args.out) / 'task_vectors.json'}")
    return 0


def _labels(paths: list[str]) -> list[str]:
    """Folder names, or the full paths where two folders share a name."""
    names = [Path(path).name or path for path in paths]
    return names if len(set(names)) == len(names) else list(paths)


def _cosine(first: TaskVector, second: TaskVector) -> float | None:
    try:
        return first.cosine(second)
    except ValueError:  # a zero task vector
        return None


def _format(value: object) -> str:
    """A table cell: n/a for None (an undefined cosine), 5 significant digits for floats."""
    if value is None:
        return "n/a"
    return f"{value:.5g}" if isinstance(value, float) else str(value)
