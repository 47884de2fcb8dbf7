"""TIES merge of three checkpoints: on disk through mergekit against in memory, wall time and peak RSS.

Three random Llama checkpoints (a base and two experts = base + small noise) are saved as sharded
safetensors. Each merge runs in its own fresh subprocess so that its peak RSS (VmHWM) is its own:

  disk    `mergecompose.merging.merge_checkpoints` (mergekit's `run_merge`, lazy tensor loading), written to disk
  memory  load the three models, `mergecompose.merging.merge("ties", ..., **MERGEKIT_MODE)`, save the result

The target: the on-disk merge's peak RSS ≤ 0.5 × the size of one input model.

    python -m benchmarks.merge             # ~300 M parameters per checkpoint
    python -m benchmarks.merge --smoke     # tiny, to prove it runs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.memory import PeakSampler, peak_rss_mib
from benchmarks.report import write_results
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import tiny_llama_config
from mergecompose.merging import MERGEKIT_MODE, merge, merge_checkpoints

OUT_SHARD_BYTES = 64 * 2**20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--density", type=float, default=0.2)
    parser.add_argument("--shard-size", default="200MB")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--out", default="benchmarks/results/merge.json")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "WORKDIR", "DENSITY"), help=argparse.SUPPRESS)
    return parser


def make_checkpoints(args, workdir: Path) -> tuple[int, int]:
    """Write base, expert_0, expert_1; return (parameters, bytes of one checkpoint's safetensors)."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        intermediate_size=args.intermediate,
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    parameters = model.num_parameters()
    model.save_pretrained(workdir / "base", max_shard_size=args.shard_size)
    base_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for index in range(2):
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(base_state[name] + 0.01 * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(workdir / f"expert_{index}", max_shard_size=args.shard_size)
    size = sum(f.stat().st_size for f in (workdir / "base").glob("*.safetensors"))
    return parameters, size


def child(mode: str, workdir: Path, density: float) -> None:
    """Run one merge; print `seconds peak_rss peak_rss_after_imports peak_anonymous_rss` (MiB, this process)."""
    import mergekit.merge  # noqa: F401 - imported before the clock: both modes pay the same imports
    import transformers  # noqa: F401

    imports_rss = peak_rss_mib()
    sampler = PeakSampler().__enter__()
    start = time.perf_counter()
    if mode == "disk":
        config = {
            "merge_method": "ties",
            "base_model": str(workdir / "base"),
            "models": [
                {"model": str(workdir / f"expert_{i}"), "parameters": {"weight": 1.0, "density": density}}
                for i in range(2)
            ],
            "parameters": {"normalize": True},
            "dtype": "float32",
        }
        # mergekit buffers output tensors until a shard is full (5 GB by default): small shards keep
        # the peak near the few tensors in flight.
        options = {"quiet": True, "lazy_unpickle": True, "out_shard_size": OUT_SHARD_BYTES}
        merge_checkpoints(config, workdir / "merged_disk", overwrite=True, options=options)
    else:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(workdir / "base")
        experts = [AutoModelForCausalLM.from_pretrained(workdir / f"expert_{i}") for i in range(2)]
        merge(
            "ties", base, experts, density=density, out_dir=workdir / "merged_memory", overwrite=True, **MERGEKIT_MODE
        )
    seconds = time.perf_counter() - start
    sampler.__exit__(None, None, None)
    print(seconds, peak_rss_mib(), imports_rss, sampler.peaks["RssAnon"])


def run_child(mode: str, workdir: Path, density: float) -> dict:
    command = [sys.executable, "-m", "benchmarks.merge", "--child", mode, str(workdir), str(density)]
    output = subprocess.run(command, capture_output=True, text=True)
    if output.returncode != 0:
        raise RuntimeError(f"the {mode} merge failed:\n{output.stderr[-3000:]}")
    seconds, rss, imports_rss, anonymous = output.stdout.strip().splitlines()[-1].split()
    return {
        "seconds": float(seconds),
        "peak_rss_mb": float(rss),
        "rss_after_imports_mb": float(imports_rss),
        "peak_anonymous_rss_mb": float(anonymous),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        mode, workdir, density = args.child
        child(mode, Path(workdir), float(density))
        return 0
    if args.smoke:
        args.hidden, args.layers, args.intermediate, args.vocab, args.shard_size = 32, 2, 64, 64, "20KB"
    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        workdir = Path(folder)
        parameters, size = make_checkpoints(args, workdir)
        results = {"parameters": parameters, "model_mb": size / 2**20, "args": vars(args)}
        for mode in ("disk", "memory"):
            results[mode] = run_child(mode, workdir, args.density)
            results[mode]["rss_over_model_size"] = results[mode]["peak_rss_mb"] / results["model_mb"]
        disk = load_tensors(workdir / "merged_disk")
        memory = load_tensors(workdir / "merged_memory")
        results["max_abs_difference_disk_vs_memory"] = max(
            (disk[name] - memory[name]).abs().max().item() for name in disk.keys() & memory.keys()
        )
    print(
        f"TIES merge of 3 checkpoints, {parameters / 1e6:.0f} M parameters each ({results['model_mb']:.0f} MiB on disk)"
    )
    header = [
        "merge",
        "wall s",
        "peak RSS MiB",
        "RSS / model size",
        "RSS after imports",
        "peak anonymous RSS",
        "anon / model size",
    ]
    table = [
        [
            mode,
            f"{row['seconds']:.1f}",
            f"{row['peak_rss_mb']:.0f}",
            f"{row['rss_over_model_size']:.2f}",
            f"{row['rss_after_imports_mb']:.0f}",
            f"{row['peak_anonymous_rss_mb']:.0f}",
            f"{row['peak_anonymous_rss_mb'] / results['model_mb']:.2f}",
        ]
        for mode, row in ((mode, results[mode]) for mode in ("disk", "memory"))
    ]
    print(markdown_table(header, table, pad=True))
    print(f"max |disk − memory| over all tensors: {results['max_abs_difference_disk_vs_memory']:.2e}")
    print(
        "target: disk peak RSS ≤ 0.5 × model size: "
        f"{'met' if results['disk']['rss_over_model_size'] <= 0.5 else 'missed'}"
    )
    write_results(results, args.out)
    return 0


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


if __name__ == "__main__":
    sys.exit(main())
