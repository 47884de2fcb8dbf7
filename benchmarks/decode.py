"""Composed decoding against the base alone, side by side in one process.

Systems, all greedy, same prompts, same number of new tokens (EOS disabled):
  (a) base    the base alone with transformers' `generate`
  (b) full    ComposedLM with two full expert models (one KV cache each)
  (c) lora    ComposedLM.from_adapters: two LoRA experts on one shared base, one batched pass
  (d) naive   re-runs base and both experts on the whole prefix every step (as DExperts does)

Timing: one warm-up, then `--repeats` rounds in which every system runs once (interleaved);
the median per system is reported as tokens/s and as a ratio to (a). Peak resident memory is
measured for each system in its own fresh subprocess (VmHWM, see benchmarks.memory).

    python -m benchmarks.decode                   # ~28 M-parameter Llama, batch 1 and 8
    python -m benchmarks.decode --smoke           # tiny sizes, one repeat (CI smoke run)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from transformers import AutoModelForCausalLM

from benchmarks.memory import peak_rss_mib
from benchmarks.report import write_results
from composition import ComposedLM, compose_logprobs
from composition.io import markdown_table
from composition.tiny import ALL_LINEAR, tiny_llama_config

SYSTEMS = ["base", "full", "lora", "naive"]


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's size, the adapters' rank, the prompts and the repeats: shared with `benchmarks.lm_eval`."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama", choices=["llama", "gemma2-2b"],
                        help="llama: sized by the flags below; gemma2-2b: a random Gemma-2-2B-shaped model")
    add_workload_arguments(parser)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--lora-implementation", default="stacked", choices=["stacked", "peft"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-system memory subprocesses")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat, to prove it runs")
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return parser


def apply_smoke(args) -> None:
    args.hidden, args.layers, args.heads, args.intermediate, args.vocab = 32, 2, 4, 64, 64
    args.rank, args.prompt_length, args.new_tokens, args.repeats = 4, 8, 8, 1
    args.batch_sizes = [1, 2]


def model_config(args):
    """The benchmark model's config: a Llama sized by the flags, or a Gemma-2-2B shape."""

    if args.arch == "gemma2-2b":
        from transformers import Gemma2Config

        # google/gemma-2-2b's shape: 26 layers, hidden 2304, 8 heads (4 KV) of 256, MLP 9216, vocab 256000.
        return Gemma2Config(
            vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
            sliding_window=4096, bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.02,
        )
    return tiny_llama_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        intermediate_size=args.intermediate, initializer_range=0.02,
    )


class Workbench:
    """The models for every system, built once from seeded random weights."""

    def __init__(self, args, systems):
        from peft import LoraConfig, PeftModel, get_peft_model

        self.args = args
        self.device = torch.device(args.device)
        dtype = getattr(torch, args.dtype)
        self.config = model_config(args)

        def fresh_base():
            # Same seed, same weights: built directly on the device, in the benchmark's dtype.
            torch.manual_seed(0)
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with self.device:
                    model = AutoModelForCausalLM.from_config(self.config)
            finally:
                torch.set_default_dtype(default_dtype)
            model.generation_config.eos_token_id = None  # every run makes exactly new_tokens tokens
            model.generation_config.pad_token_id = 0
            return model.eval()

        self._folder = tempfile.TemporaryDirectory()
        base = fresh_base()
        self.parameters = base.num_parameters()
        adapter_dirs = []
        for index in range(2):
            torch.manual_seed(10 + index)
            lora = LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=ALL_LINEAR, init_lora_weights=False)
            peft_model = get_peft_model(base, lora)
            with torch.no_grad():
                for name, parameter in peft_model.named_parameters():
                    if "lora_" in name:
                        parameter.mul_(0.05)
            adapter_dirs.append(Path(self._folder.name) / f"expert_{index}")
            peft_model.save_pretrained(str(adapter_dirs[-1]))
            base = peft_model.unload()
        del base, peft_model

        self.systems = {}
        experts = []
        if {"full", "naive"} & set(systems):
            for adapter_dir in adapter_dirs:
                experts.append(PeftModel.from_pretrained(fresh_base(), str(adapter_dir)).merge_and_unload().eval())
        if {"base", "full", "naive"} & set(systems):
            self.base = fresh_base()
        if "base" in systems:
            self.systems["base"] = self._run_base
        if "full" in systems:
            self.full = ComposedLM(self.base, experts)
            self.systems["full"] = lambda ids, mask: self.full.generate(ids, mask, max_new_tokens=args.new_tokens)
        if "lora" in systems:
            self.lora = ComposedLM.from_adapters(
                fresh_base(), {f"expert_{i}": str(d) for i, d in enumerate(adapter_dirs)},
                lora_implementation=args.lora_implementation,
            )
            self.systems["lora"] = lambda ids, mask: self.lora.generate(ids, mask, max_new_tokens=args.new_tokens)
        if "naive" in systems:
            self.naive_models = [self.base, *experts]
            self.systems["naive"] = self._run_naive

    @torch.no_grad()
    def _run_base(self, ids, mask):
        return self.base.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=self.args.new_tokens,
            min_new_tokens=self.args.new_tokens, do_sample=False,
        )

    @torch.no_grad()
    def _run_naive(self, ids, mask):

        for _ in range(self.args.new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = [m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1] for m in self.naive_models]
            next_tokens = compose_logprobs(logits[0], logits[1:]).argmax(-1)
            ids = torch.cat([ids, next_tokens[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return ids

    def prompts(self, batch):
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, self.config.vocab_size, (batch, self.args.prompt_length), generator=generator)
        return ids.to(self.device), torch.ones_like(ids).to(self.device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_systems(bench: Workbench, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds per run of each system, interleaved, after one warm-up each."""
    ids, mask = bench.prompts(batch)
    for run in bench.systems.values():
        run(ids, mask)
    seconds = {name: [] for name in bench.systems}
    for _ in range(repeats):
        for name, run in bench.systems.items():
            _sync(bench.device)
            start = time.perf_counter()
            out = run(ids, mask)
            _sync(bench.device)
            seconds[name].append(time.perf_counter() - start)
            if out.shape[1] != ids.shape[1] + bench.args.new_tokens:
                raise RuntimeError(f"{name} made {out.shape[1] - ids.shape[1]} tokens, not {bench.args.new_tokens}")
    return {name: statistics.median(values) for name, values in seconds.items()}


def peak_rss_mb(args, system: str) -> float:
    """Peak RSS (MiB; on CUDA, peak device memory) of a fresh process that builds only `system` and decodes batch 1 once."""
    command = [sys.executable, "-m", "benchmarks.decode", "--memory-child", system]
    for key in ["hidden", "layers", "heads", "intermediate", "vocab", "rank", "prompt_length", "new_tokens"]:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    command += ["--dtype", args.dtype, "--device", args.device, "--arch", args.arch,
                "--lora-implementation", args.lora_implementation]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(output.strip().splitlines()[-1])


def memory_child(args) -> None:
    bench = Workbench(args, [args.memory_child])
    ids, mask = bench.prompts(1)
    bench.systems[args.memory_child](ids, mask)
    if bench.device.type == "cuda":
        print(torch.cuda.max_memory_allocated() / 2**20)  # peak device memory, MiB
    else:
        print(peak_rss_mib())  # peak RSS, MiB


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return 0
    if args.smoke:
        apply_smoke(args)
    bench = Workbench(args, args.systems)
    parameters = bench.parameters
    results = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
               "device": args.device, "dtype": args.dtype, "parameters": parameters, "args": vars(args), "batches": {}}
    print(f"decode benchmark: {parameters / 1e6:.1f} M parameters, {args.dtype} on {args.device}, "
          f"prompt {args.prompt_length}, {args.new_tokens} new tokens, median of {args.repeats}")
    for batch in args.batch_sizes:
        medians = time_systems(bench, batch, args.repeats)
        rows = {}
        for name, seconds in medians.items():
            tokens_per_second = batch * args.new_tokens / seconds
            rows[name] = {"seconds": seconds, "tokens_per_second": tokens_per_second}
        if "base" in rows:
            for name in rows:
                rows[name]["ratio_to_base"] = rows[name]["tokens_per_second"] / rows["base"]["tokens_per_second"]
        results["batches"][str(batch)] = rows
    if not args.no_memory:
        results["peak_rss_mb"] = {name: peak_rss_mb(args, name) for name in args.systems}
    print_table(results)
    write_results(results, args.out)
    return 0


def print_table(results) -> None:
    names = {"base": "(a) base generate", "full": "(b) composed, full", "lora": "(c) composed, LoRA", "naive": "(d) naive re-run"}
    rows = [
        [names[name], batch, f"{row['tokens_per_second']:.1f}", f"{row['ratio_to_base']:.3f}" if "ratio_to_base" in row else "-"]
        for batch, batch_rows in results["batches"].items()
        for name, row in batch_rows.items()
    ]
    print(markdown_table(["system", "batch", "tokens/s", "ratio to (a)"], rows, pad=True))
    if "peak_rss_mb" in results:
        memory = results["peak_rss_mb"]
        rows = [
            [names[name], f"{value:.1f}", f"{value / memory['base']:.3f}" if "base" in memory else "-"]
            for name, value in memory.items()
        ]
        print(markdown_table(["system", "peak RSS MiB", "ratio to (a)"], rows, pad=True))

if __name__ == "__main__":
    sys.exit(main())
