"""Composition at Gemma-2-2B size: base, LoRA composition, full composition, full composition + merged draft.

A random base of google/gemma-2-2b's shape (`benchmarks.shapes.gemma2_2b_config`: vocabulary 256,000, hidden 2,304,
26 layers, sliding window 4,096; eager attention, which applies Gemma-2's soft-capping) in bfloat16 on the GPU, and
two kinds of experts:

  - two full experts = the base plus Gaussian noise of `--noise` times each weight matrix's own standard deviation,
    so that their task-arithmetic merge θ_b + (θ_1 − θ_b) + (θ_2 − θ_b) is a plausible draft;
  - two LoRA adapters of rank `--rank` on all seven projections, random factors times `--lora-scale`
    (`init_lora_weights=False`, as `benchmarks.decode` makes its random LoRA experts).

Systems, greedy by default, the same random prompt, `--new-tokens` tokens each (EOS off):

  base        transformers' `generate` on the base alone
  lora        `ComposedLM.from_adapters`: the two LoRA experts on one copy of the base, one batched pass a token
  full        `ComposedLM` of the two full experts (3 forward passes a token, one KV cache each)
  full+spec   the same with `draft="merged"` and K = `--draft-tokens` (adaptive: it may fall back to plain steps)

One warm-up each (the merged draft is built before it, and timed on its own), then `--repeats` interleaved runs;
median tokens/s, ratios, the acceptance rate a and tokens per round, whether the greedy outputs of `full` and
`full+spec` agree (in bfloat16 one pass over K+1 tokens and K+1 passes over one can round differently, so a
near-tie may flip). Peak GPU memory of each system (`peak_gpu_memory_gib`) is the memory its models hold (what
building them allocated: the base; the LoRA system's own base copy and adapters; the two full experts; the merged
draft) plus the peak its warm-up run allocated above what was allocated before it (`run_peak_gib`). Prints one JSON
line (and writes it to `--out`).

    python -m benchmarks.decode_gpu_gemma                 # H200: figures in benchmarks/README.md
    python -m benchmarks.decode_gpu_gemma --tiny          # a 2-layer Gemma-2 in float32 on the CPU, to check the script
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.report import write_results
from benchmarks.shapes import gemma2_2b_config
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_lora_adapter

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=32,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer Gemma-2 in float32 on the CPU (a check of the script)"
    )
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="default: bfloat16, float32 with --tiny",
    )
    parser.add_argument(
        "--noise", type=float, default=0.01, help="experts = base + noise · (each matrix's std) · N(0, 1)"
    )
    parser.add_argument("--rank", type=int, default=8, help="the LoRA experts' rank")
    parser.add_argument("--lora-scale", type=float, default=0.05, help="the LoRA experts' random factors times this")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--draft-tokens", type=int, default=4, help="K")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 1) instead of greedy decoding")
    parser.add_argument("--out", default="benchmarks/results/decode_gpu_gemma.json")
    return parser


def build_models(args):
    """The base (seed 0) and two experts (seeds 1, 2) on the device, in the run's dtype, with eager attention."""
    config = gemma2_2b_config()
    if args.tiny:
        for key, value in TINY.items():
            setattr(config, key, value)
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            base = AutoModelForCausalLM.from_config(
                config, attn_implementation="eager"
            ).eval()  # SDPA skips soft-capping
    finally:
        torch.set_default_dtype(default_dtype)
    base.generation_config.eos_token_id = None  # every run makes exactly new_tokens tokens
    base.generation_config.pad_token_id = 0
    experts = []
    for seed in (1, 2):
        expert = copy.deepcopy(base)
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for parameter in expert.parameters():
                if parameter.dim() > 1:
                    noise = torch.randn(parameter.shape, generator=generator, device=device, dtype=dtype)
                    parameter.add_(noise, alpha=args.noise * parameter.float().std().item())
        experts.append(expert)
    return base, experts


def _allocated(device: torch.device) -> int:
    _sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _gib(count: int) -> float:
    return round(count / 2**30, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    held = {}  # bytes each part's building allocated on the device
    started, before = time.perf_counter(), _allocated(device)
    base, experts = build_models(args)
    after = _allocated(device)
    build_seconds = time.perf_counter() - started
    held["base"] = base.num_parameters() * base.dtype.itemsize if cuda else 0
    held["full_experts"] = after - before - held["base"]
    folder = tempfile.TemporaryDirectory()
    adapters = {
        f"expert_{index}": str(
            random_lora_adapter(
                base, Path(folder.name) / f"expert_{index}", 10 + index, args.rank, scale=args.lora_scale
            )
        )
        for index in range(2)
    }
    before = _allocated(device)
    lora_base = copy.deepcopy(base)
    lora = ComposedLM.from_adapters(lora_base, adapters)
    held["lora"] = _allocated(device) - before
    lm = ComposedLM(base, experts)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt_length), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    mask = torch.ones_like(ids)
    sampling = {"do_sample": True, "seed": 0} if args.sample else {}
    systems = {
        "base": lambda: base.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=args.sample,
        ),
        "lora": lambda: lora.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=[], **sampling),
        "full": lambda: lm.generate(ids, mask, max_new_tokens=args.new_tokens, eos_token_id=[], **sampling),
        "full+spec": lambda: lm.generate(
            ids,
            mask,
            max_new_tokens=args.new_tokens,
            eos_token_id=[],
            draft="merged",
            num_draft_tokens=args.draft_tokens,
            **sampling,
        ),
    }
    before, started = _allocated(device), time.perf_counter()
    lm.merged_draft()
    _sync(device)
    merge_seconds = time.perf_counter() - started
    held["merged_draft"] = _allocated(device) - before
    holds = {
        "base": held["base"],
        "lora": held["lora"],
        "full": held["base"] + held["full_experts"],
        "full+spec": held["base"] + held["full_experts"] + held["merged_draft"],
    }

    outputs, run_peak, seconds, acceptance = {}, {}, {name: [] for name in systems}, []
    for name, run in systems.items():  # warm-up, and each system's own peak above what is allocated
        before = _allocated(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        outputs[name] = run()
        _sync(device)
        run_peak[name] = torch.cuda.max_memory_allocated(device) - before if cuda else 0
    for _ in range(args.repeats):
        for name, run in systems.items():
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            seconds[name].append(time.perf_counter() - start)
            if name == "full+spec":
                acceptance.append(lm.speculation_stats.as_dict())
    tokens = args.batch * args.new_tokens
    speed = {name: tokens / statistics.median(values) for name, values in seconds.items()}
    full, spec = outputs["full"][:, args.prompt_length :], outputs["full+spec"][:, args.prompt_length :]
    agree = (full == spec).cumprod(dim=1).sum(dim=1)  # (B,) tokens equal before the first difference
    result = {
        "benchmark": "decode_gpu_gemma",
        "device": torch.cuda.get_device_name(device) if cuda else args.device,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "parameters": base.num_parameters(),
        "noise": args.noise,
        "rank": args.rank,
        "lora_scale": args.lora_scale,
        "batch": args.batch,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "draft_tokens": args.draft_tokens,
        "decoding": "sample" if args.sample else "greedy",
        "repeats": args.repeats,
        "tokens_per_second": {name: round(value, 2) for name, value in speed.items()},
        "lora_over_base": round(speed["lora"] / speed["base"], 3),
        "full_over_base": round(speed["full"] / speed["base"], 3),
        "spec_over_full": round(speed["full+spec"] / speed["full"], 3),
        "spec_over_base": round(speed["full+spec"] / speed["base"], 3),
        "acceptance_rate": round(statistics.mean(run["acceptance_rate"] for run in acceptance), 4),
        "tokens_per_round": round(statistics.mean(run["tokens_per_round"] for run in acceptance), 3),
        "greedy_outputs_equal": None if args.sample else bool(torch.equal(full, spec)),
        "tokens_equal_before_first_difference": None if args.sample else agree.tolist(),
        "build_seconds": round(build_seconds, 1),
        "merge_seconds": round(merge_seconds, 2),
        "peak_gpu_memory_gib": {name: _gib(holds[name] + run_peak[name]) for name in systems} if cuda else None,
        "held_gib": {name: _gib(count) for name, count in held.items()} if cuda else None,
        "run_peak_gib": {name: _gib(count) for name, count in run_peak.items()} if cuda else None,
        "peak_gpu_memory_gib_all": _gib(torch.cuda.max_memory_allocated(device)) if cuda else None,
    }
    print(json.dumps(result))
    write_results(result, args.out)
    folder.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
