"""Speculative decoding of two composed full experts at Gemma-2-2B size: base, composition, composition + merged draft.

A random base of google/gemma-2-2b's shape (`benchmarks.decode.model_config`: vocabulary 256,000, hidden 2,304,
26 layers, sliding window 4,096; eager attention, which applies Gemma-2's soft-capping) in bfloat16 on the GPU, and
two full experts = the base plus Gaussian noise of `--noise` times each weight matrix's own standard deviation, so
that their task-arithmetic merge θ_b + (θ_1 − θ_b) + (θ_2 − θ_b) is a plausible draft. Systems, greedy by default,
the same random prompt, `--new-tokens` tokens each (EOS off):

  base        transformers' `generate` on the base alone
  full        `ComposedLM` of the two experts (3 forward passes a token, one KV cache each)
  full+spec   the same with `draft="merged"` and K = `--draft-tokens`

One warm-up each (the merged draft is built there, and timed on its own), then `--repeats` interleaved runs;
median tokens/s, ratios to `full` and to `base`, the acceptance rate a and tokens per round, whether the greedy
outputs of `full` and `full+spec` agree (in bfloat16 one pass over K+1 tokens and K+1 passes over one can round
differently, so a near-tie may flip), and the peak GPU memory. Prints one JSON line (and writes it to `--out`).

    python -m benchmarks.decode_gpu_gemma                 # H200: figures in benchmarks/README.md
    python -m benchmarks.decode_gpu_gemma --tiny          # a 2-layer Gemma-2 in float32 on the CPU, to check the script
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from benchmarks.decode import model_config
from benchmarks.report import write_results
from mergecompose.composition import ComposedLM

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
    config = model_config(argparse.Namespace(arch="gemma2-2b"))
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    device = torch.device(args.device)
    started = time.perf_counter()
    base, experts = build_models(args)
    _sync(device)
    build_seconds = time.perf_counter() - started
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
    _sync(device)
    started = time.perf_counter()
    lm.merged_draft()
    _sync(device)
    merge_seconds = time.perf_counter() - started

    outputs, seconds, acceptance = {}, {name: [] for name in systems}, []
    for name, run in systems.items():  # warm-up
        outputs[name] = run()
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
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else args.device,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "parameters": base.num_parameters(),
        "noise": args.noise,
        "batch": args.batch,
        "prompt_length": args.prompt_length,
        "new_tokens": args.new_tokens,
        "draft_tokens": args.draft_tokens,
        "decoding": "sample" if args.sample else "greedy",
        "repeats": args.repeats,
        "tokens_per_second": {name: round(value, 2) for name, value in speed.items()},
        "spec_over_full": round(speed["full+spec"] / speed["full"], 3),
        "spec_over_base": round(speed["full+spec"] / speed["base"], 3),
        "full_over_base": round(speed["full"] / speed["base"], 3),
        "acceptance_rate": round(statistics.mean(run["acceptance_rate"] for run in acceptance), 4),
        "tokens_per_round": round(statistics.mean(run["tokens_per_round"] for run in acceptance), 3),
        "greedy_outputs_equal": None if args.sample else bool(torch.equal(full, spec)),
        "tokens_equal_before_first_difference": None if args.sample else agree.tolist(),
        "build_seconds": round(build_seconds, 1),
        "merge_seconds": round(merge_seconds, 2),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }
    print(json.dumps(result))
    write_results(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
