"""Streaming overlap diagnostics: time on top of the bare forward passes, and memory against tokens.

Model: the decode benchmark's random Llama (~27 M parameters, vocab 8192) with 2 LoRA experts on
one base (`ComposedLM.from_adapters`). Data: random token sequences of `--seq-length`.

  bare      `component_logprobs` + `compose_with_remedies` on every batch (the forward passes q needs)
  analysis  `analysis.measure_overlap` on the same batches (the same passes + the streaming reduction)

Overhead = analysis / bare − 1, at 10 k and 100 k tokens (interleaved, median of `--repeats`).
Memory: each token count runs `measure_overlap` in its own subprocess; peak RSS (VmHWM) and peak
anonymous RSS must stay flat in the number of tokens (targets: overhead ≤ 15 %, memory within 10 %).

    python -m benchmarks.analysis
    python -m benchmarks.analysis --smoke
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.memory import PeakSampler, peak_rss_mib
from benchmarks.report import write_results
from analysis import measure_overlap
from composition import ComposedLM, compose_with_remedies
from composition.io import markdown_table
from composition.tiny import random_llama, random_lora_adapter, tiny_llama_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/analysis.json")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def apply_smoke(args) -> None:
    args.hidden, args.layers, args.intermediate, args.vocab = 32, 2, 64, 64
    args.seq_length, args.batch_size, args.tokens, args.repeats = 16, 2, [64, 256], 1


class Setup:
    def __init__(self, args):

        config = tiny_llama_config(
            vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
            num_heads=max(1, args.hidden // 64), intermediate_size=args.intermediate, initializer_range=0.02,
        )
        self._folder = tempfile.TemporaryDirectory()
        base = random_llama(config, seed=0)
        adapters = {
            f"expert_{i}": str(random_lora_adapter(base, Path(self._folder.name) / f"e{i}", seed=10 + i, scale=0.3))
            for i in range(2)
        }
        self.composed = ComposedLM.from_adapters(base, adapters)
        self.args = args

    def batches(self, tokens: int):
        """Seeded random batches holding `tokens` positions in all."""
        generator = torch.Generator().manual_seed(0)
        per_batch = self.args.batch_size * self.args.seq_length
        for start in range(0, tokens, per_batch):
            rows = max(1, min(self.args.batch_size, (tokens - start) // self.args.seq_length))
            ids = torch.randint(3, self.args.vocab, (rows, self.args.seq_length), generator=generator)
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    @torch.no_grad()
    def bare(self, tokens: int) -> None:

        for batch in self.batches(tokens):
            components = self.composed.component_logprobs(batch["input_ids"], batch["attention_mask"])
            compose_with_remedies(components, self.composed.weights, self.composed.remedies)

    @torch.no_grad()
    def analysis(self, tokens: int):

        return measure_overlap(self.composed, self.batches(tokens), progress=False)


def memory_child(args) -> None:
    setup = Setup(args)
    before = peak_rss_mib()
    with PeakSampler() as sampler:
        setup.analysis(args.memory_child)
    print(peak_rss_mib(), sampler.peaks["RssAnon"], before)


def memory(args, tokens: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.analysis", "--memory-child", str(tokens)]
    for key in ["hidden", "layers", "intermediate", "vocab", "seq_length", "batch_size"]:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    output = subprocess.run(command, capture_output=True, text=True)
    if output.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{output.stderr[-3000:]}")
    peak, anonymous, before = (float(v) for v in output.stdout.strip().splitlines()[-1].split())
    return {"peak_rss_mb": peak, "peak_anonymous_rss_mb": anonymous, "rss_before_analysis_mb": before}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child is not None:
        memory_child(args)
        return 0
    if args.smoke:
        apply_smoke(args)
    setup = Setup(args)
    setup.bare(args.tokens[0])  # warm-up
    setup.analysis(args.tokens[0])
    results = {"args": vars(args), "tokens": {}}
    for tokens in args.tokens:
        seconds = {"bare": [], "analysis": []}
        for _ in range(args.repeats):
            for name in ("bare", "analysis"):
                start = time.perf_counter()
                getattr(setup, name)(tokens)
                seconds[name].append(time.perf_counter() - start)
        bare, analysis = statistics.median(seconds["bare"]), statistics.median(seconds["analysis"])
        results["tokens"][str(tokens)] = {
            "bare_seconds": bare, "analysis_seconds": analysis, "overhead": analysis / bare - 1,
            **memory(args, tokens),
        }
    rows = results["tokens"]
    first, last = rows[str(args.tokens[0])], rows[str(args.tokens[-1])]
    results["memory_growth"] = last["peak_rss_mb"] / first["peak_rss_mb"] - 1
    results["anonymous_memory_growth"] = last["peak_anonymous_rss_mb"] / first["peak_anonymous_rss_mb"] - 1
    print(f"streaming analysis, 2 LoRA experts, vocab {args.vocab}, median of {args.repeats}")
    table = [
        [tokens, f"{row['bare_seconds']:.2f}", f"{row['analysis_seconds']:.2f}", f"{row['overhead']:.1%}",
         f"{row['peak_rss_mb']:.0f}", f"{row['peak_anonymous_rss_mb']:.0f}"]
        for tokens, row in rows.items()
    ]
    print(markdown_table(["tokens", "bare s", "analysis s", "overhead", "peak RSS MiB", "peak anon MiB"], table, pad=True))
    print(f"memory growth {args.tokens[0]} -> {args.tokens[-1]} tokens: {results['memory_growth']:+.1%} (RSS), "
          f"{results['anonymous_memory_growth']:+.1%} (anonymous); targets: overhead ≤ 15 %, growth ≤ 10 %")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
