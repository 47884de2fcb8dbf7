"""Streaming overlap diagnostics: time on top of the bare forward passes, memory against tokens, a profile.

Model: a random Llama (default hidden 512, 8 layers, MLP 1024, vocab 32,000; issue 16) with 2 LoRA
experts of rank 16 on one base (`ComposedLM.from_adapters`), or with `--arch gemma2-2b` a random
Gemma-2-2B-shaped model (vocab 256,000; for a GPU, `--device cuda --dtype bfloat16`). Data: random
token sequences of `--seq-length`.

  bare      `component_logprobs` + `compose_with_remedies` on every batch (the forward passes q needs)
  analysis  `mergecompose.analysis.measure_overlap` on the same batches (the same passes + the streaming reduction),
            with the default settings (base-weighted centre, token statistics on the top-k union), or
            over the whole vocabulary with `--full-vocabulary`

Overhead = analysis / bare − 1 at each of `--tokens`, from `--repeats` interleaved runs (median).
Memory: each of `--memory-tokens` (default `--tokens`) runs `measure_overlap` in its own
subprocess; peak RSS (VmHWM) and peak anonymous RSS (on CUDA: peak device memory) must stay flat
in the number of tokens. `--profile N` adds the top entries of cProfile over `measure_overlap` on N
tokens. Targets: overhead ≤ 15 %, memory within 10 %.

    python -m benchmarks.analysis                                   # vocab 32,000 at 10 k and 100 k tokens
    python -m benchmarks.analysis --vocab 8192 --tokens 10000
    python -m benchmarks.analysis --vocab 128000 --batch-size 2 --tokens 10000
    python -m benchmarks.analysis --arch gemma2-2b --device cuda --dtype bfloat16 --tokens 10000 100000
    python -m benchmarks.analysis --smoke
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.decode import model_config
from benchmarks.memory import PeakSampler, peak_rss_mib
from benchmarks.report import write_results
from mergecompose.analysis import OverlapSettings, measure_overlap
from mergecompose.composition import ComposedLM, compose_with_remedies
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import random_lora_adapter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama", choices=["llama", "gemma2-2b"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--memory-tokens", type=int, nargs="*", default=None, help="default: --tokens; none: skip")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--full-vocabulary", action="store_true", help="measure with OverlapSettings(full_vocabulary=True)"
    )
    parser.add_argument("--centre", default=None, choices=["median", "base_weighted_median"])
    parser.add_argument(
        "--profile", type=int, default=None, metavar="TOKENS", help="cProfile measure_overlap on TOKENS"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/analysis.json")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def apply_smoke(args) -> None:
    args.hidden, args.layers, args.heads, args.intermediate, args.vocab, args.rank = 32, 2, 4, 64, 64, 4
    args.seq_length, args.batch_size, args.tokens, args.repeats = 16, 2, [64, 256], 1
    args.memory_tokens, args.profile = None, 64


def settings_of(args) -> OverlapSettings:
    values = {"full_vocabulary": args.full_vocabulary}
    if args.centre:
        values["centre"] = args.centre
    return OverlapSettings(**values)


class Setup:
    def __init__(self, args):
        self.device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        self._folder = tempfile.TemporaryDirectory()
        # Seeded random weights, built on the device in the benchmark's dtype (as benchmarks.decode does).
        torch.manual_seed(0)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with self.device:
                base = AutoModelForCausalLM.from_config(model_config(args)).eval()
        finally:
            torch.set_default_dtype(default_dtype)
        adapters = {
            f"expert_{i}": str(
                random_lora_adapter(base, Path(self._folder.name) / f"e{i}", seed=10 + i, rank=args.rank, scale=0.3)
            )
            for i in range(2)
        }
        self.composed = ComposedLM.from_adapters(base, adapters)
        self.vocab = base.config.vocab_size
        self.parameters = base.num_parameters()
        self.settings = settings_of(args)
        self.args = args

    def batches(self, tokens: int):
        """Seeded random batches holding `tokens` positions in all."""
        generator = torch.Generator().manual_seed(0)
        per_batch = self.args.batch_size * self.args.seq_length
        for start in range(0, tokens, per_batch):
            rows = max(1, min(self.args.batch_size, (tokens - start) // self.args.seq_length))
            ids = torch.randint(3, self.vocab, (rows, self.args.seq_length), generator=generator)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def bare(self, tokens: int) -> None:
        for batch in self.batches(tokens):
            components = self.composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
            compose_with_remedies(components, self.composed.weights, self.composed.remedies)
        self._sync()

    @torch.no_grad()
    def analysis(self, tokens: int):
        report = measure_overlap(self.composed, self.batches(tokens), settings=self.settings, progress=False)
        self._sync()
        return report


def memory_child(args) -> None:
    setup = Setup(args)
    before = peak_rss_mib()
    with PeakSampler() as sampler:
        setup.analysis(args.memory_child)
    device_peak = torch.cuda.max_memory_allocated() / 2**20 if setup.device.type == "cuda" else 0.0
    print(peak_rss_mib(), sampler.peaks["RssAnon"], before, device_peak)


def memory(args, tokens: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.analysis", "--memory-child", str(tokens)]
    for key in [
        "arch",
        "hidden",
        "layers",
        "heads",
        "intermediate",
        "vocab",
        "rank",
        "seq_length",
        "batch_size",
        "device",
        "dtype",
    ]:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.full_vocabulary:
        command.append("--full-vocabulary")
    if args.centre:
        command += ["--centre", args.centre]
    output = subprocess.run(command, capture_output=True, text=True)
    if output.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{output.stderr[-3000:]}")
    peak, anonymous, before, device = (float(v) for v in output.stdout.strip().splitlines()[-1].split())
    return {
        "peak_rss_mb": peak,
        "peak_anonymous_rss_mb": anonymous,
        "rss_before_analysis_mb": before,
        "peak_device_mb": device,
    }


def profile(setup: Setup, tokens: int, top: int = 15) -> list[str]:
    """The `top` entries of cProfile (by own time) over `measure_overlap` on `tokens` tokens."""
    profiler = cProfile.Profile()
    profiler.enable()
    setup.analysis(tokens)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("ncalls"))
    return [line for line in lines[start:] if line.strip()]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child is not None:
        memory_child(args)
        return 0
    if args.smoke:
        apply_smoke(args)
    setup = Setup(args)
    warm = min(args.tokens[0], 2 * args.batch_size * args.seq_length)
    setup.bare(warm)  # warm-up, and the vocabulary pass's compilation (once per process)
    setup.analysis(warm)
    results = {
        "args": vars(args),
        "settings": setup.settings.model_dump(),
        "base_parameters": setup.parameters,
        "tokens": {},
    }
    for tokens in args.tokens:
        seconds = {"bare": [], "analysis": []}
        for _ in range(args.repeats):
            for name in ("bare", "analysis"):
                start = time.perf_counter()
                getattr(setup, name)(tokens)
                seconds[name].append(time.perf_counter() - start)
        bare, analysis = statistics.median(seconds["bare"]), statistics.median(seconds["analysis"])
        results["tokens"][str(tokens)] = {
            "bare_seconds": bare,
            "analysis_seconds": analysis,
            "overhead": analysis / bare - 1,
            "bare_runs": seconds["bare"],
            "analysis_runs": seconds["analysis"],
        }
        print(
            f"{tokens} tokens: bare {bare:.2f} s, analysis {analysis:.2f} s, overhead {analysis / bare - 1:+.1%}",
            flush=True,
        )
    memory_tokens = args.tokens if args.memory_tokens is None else args.memory_tokens
    results["memory"] = {str(tokens): memory(args, tokens) for tokens in memory_tokens}
    if len(memory_tokens) >= 2:
        first, last = results["memory"][str(memory_tokens[0])], results["memory"][str(memory_tokens[-1])]
        results["memory_growth"] = last["peak_rss_mb"] / first["peak_rss_mb"] - 1
        results["anonymous_memory_growth"] = last["peak_anonymous_rss_mb"] / first["peak_anonymous_rss_mb"] - 1
    if args.profile:
        results["profile"] = profile(setup, args.profile)
        print("\n".join(results["profile"]))
    print(f"streaming analysis, 2 LoRA experts of rank {args.rank}, vocab {setup.vocab}, median of {args.repeats}")
    table = [
        [tokens, f"{row['bare_seconds']:.2f}", f"{row['analysis_seconds']:.2f}", f"{row['overhead']:.1%}"]
        for tokens, row in results["tokens"].items()
    ]
    print(markdown_table(["tokens", "bare s", "analysis s", "overhead"], table, pad=True))
    memory_table = [
        [tokens, f"{row['peak_rss_mb']:.0f}", f"{row['peak_anonymous_rss_mb']:.0f}", f"{row['peak_device_mb']:.0f}"]
        for tokens, row in results["memory"].items()
    ]
    if memory_table:
        print(markdown_table(["tokens", "peak RSS MiB", "peak anon MiB", "peak device MiB"], memory_table, pad=True))
    if "memory_growth" in results:
        print(
            f"memory growth {memory_tokens[0]} -> {memory_tokens[-1]} tokens: {results['memory_growth']:+.1%} (RSS), "
            f"{results['anonymous_memory_growth']:+.1%} (anonymous)"
        )
    print("targets: overhead ≤ 15 %, memory growth ≤ 10 %")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
