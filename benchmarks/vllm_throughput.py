"""Composed decoding in vLLM against the base alone, on the CPU: tokens/s at batch 1 and 16, as ratios.

Run in the vLLM environment (`make install-vllm`):

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m benchmarks.vllm_throughput

A random Llama base (hidden 256, 4 layers, 4 heads, vocabulary 2,048, float32), two random LoRA experts (rank 8,
every projection) and two full experts, saved to a temporary folder; `mergecompose vllm-model` folders for
both compositions. Each system gets its own engine, one after the other in this process; each batch of
prompts (length 16) decodes `--new-tokens` tokens greedily, EOS ignored, after one warm-up batch. Ratios are
composed tokens/s over the base's, measured in the same run, by the clock and per CPU-second of this process (the
steadier figure on shared cores). Every system's engine is built first and kept; then each of `--repeats` rounds
times one batch of every system in turn (interleaved), and each point is the median of its rounds. `--profile N`
then runs one batch of each system at the first batch size under torch.profiler and prints its N most expensive
operators (self CPU time); `--systems` picks the systems.

With `--model DIR|NAME` (and `--expert DIR…`, benchmarks/real_model.py) the base and its LoRA experts are those
checkpoints instead; the full-expert composition then uses each adapter merged into a copy of the base:

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m benchmarks.vllm_throughput \
        --model smollm2-135m-instruct --repeats 7 --profile 20
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lm_eval import benchmark_characters
from benchmarks.real_model import add_model_arguments, real_workload
from benchmarks.report import conditions, conditions_line, profile_table, write_results
from mergecompose.analysis.data import SPECIAL_TOKENS, char_tokenizer
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.integrations.vllm.folder import build_vllm_model

# --systems names -> the systems' names in tables and results.
SYSTEMS = {"base": "base", "lora": "composed, 2 LoRA experts", "full": "composed, 2 full experts"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="head_dim = hidden / heads must be >= 32 on the CPU")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds; each point is their median")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timings, run one batch of each system at the first batch size under torch.profiler and "
        "print its N most expensive operators (self CPU time)",
    )
    parser.add_argument("--out", default="benchmarks/results/vllm_throughput.json")
    add_model_arguments(parser)
    return parser


def save_models(args, folder: Path) -> dict[str, Path]:
    """The base (with a tokenizer) and the two compositions' model folders."""
    config = tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        initializer_range=0.05,
    )
    base = random_llama(config, seed=0)
    base.save_pretrained(folder / "base")
    char_tokenizer(benchmark_characters(args.vocab - len(SPECIAL_TOKENS))).save_pretrained(folder / "base")
    loras = [
        random_lora_adapter(base, folder / f"lora_{index}", seed=10 + index, rank=8, scale=0.05) for index in range(2)
    ]
    fulls = []
    for index in range(2):
        random_llama(config, seed=20 + index).save_pretrained(folder / f"full_{index}")
        fulls.append(folder / f"full_{index}")
    return {
        "base": folder / "base",
        "composed, 2 LoRA experts": build_vllm_model(folder / "composed_lora", folder / "base", loras),
        "composed, 2 full experts": build_vllm_model(folder / "composed_full", folder / "base", fulls),
    }


def save_real_models(args, folder: Path) -> dict[str, Path]:
    """The real base, a composition of its LoRA experts and one of the same experts merged into full checkpoints."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    base, experts = real_workload(args.model, args.expert)
    if any(not (Path(expert) / "adapter_config.json").is_file() for expert in experts):
        raise SystemExit("--expert: this benchmark needs LoRA adapters (it also merges them into full experts)")
    args.vocab = AutoConfig.from_pretrained(base).vocab_size
    fulls = []
    for index, adapter in enumerate(experts):
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload()
        merged.save_pretrained(folder / f"full_{index}")
        fulls.append(folder / f"full_{index}")
    return {
        "base": Path(base),
        "composed, 2 LoRA experts": build_vllm_model(folder / "composed_lora", base, experts),
        "composed, 2 full experts": build_vllm_model(folder / "composed_full", base, fulls),
    }


def prompts_and_params(args, batch: int):
    """`batch` prompts of 16 random ids (seeded by the batch size); greedy sampling of `--new-tokens`, EOS ignored."""
    from vllm import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(len(SPECIAL_TOKENS), args.vocab, (16,), generator=generator).tolist()}
        for _ in range(batch)
    ]
    return prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)


def time_batch(engine, prompts, params) -> dict[str, float]:
    """{"wall": seconds, "cpu": CPU-seconds of this process, "tokens": tokens made} of one batch.

    vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so its CPU time is this process's; on shared
    cores the CPU-time rate is the steadier one."""
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return {"wall": wall, "cpu": cpu, "tokens": sum(len(output.outputs[0].token_ids) for output in outputs)}


def interleaved_rates(engines: dict, args) -> dict[str, dict[int, dict[str, float]]]:
    """Tokens per second and per CPU-second of each system at each batch size: one warm-up batch each, then
    `--repeats` rounds in which every system decodes one batch in turn; the median of the rounds."""
    rates: dict[str, dict[int, dict[str, float]]] = {system: {} for system in engines}
    for batch in args.batches:
        prompts, params = prompts_and_params(args, batch)
        for engine in engines.values():
            engine.generate(prompts, params, use_tqdm=False)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {system: [] for system in engines}
        for _ in range(args.repeats):
            for system, engine in engines.items():
                runs[system].append(time_batch(engine, prompts, params))
        for system, timed in runs.items():
            rates[system][batch] = {
                clock: statistics.median(run["tokens"] / run[clock] for run in timed) for clock in ("wall", "cpu")
            }
    return rates


def profile_engines(engines: dict, args, rows: int) -> dict[str, list[dict]]:
    """Each system's `rows` most expensive operators (self CPU time) in one batch at the first batch size."""
    prompts, params = prompts_and_params(args, args.batches[0])
    return {
        system: profile_table(
            lambda engine=engine: engine.generate(prompts, params, use_tqdm=False),
            f"{system}, batch {args.batches[0]}",
            rows,
        )
        for system, engine in engines.items()
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM  # after the environment above, which vLLM reads at import

    results: dict = {"settings": vars(args), "systems": {}}
    with tempfile.TemporaryDirectory() as temporary:
        folders = save_real_models(args, Path(temporary)) if args.model else save_models(args, Path(temporary))
        wanted = {SYSTEMS[name] for name in ["base", *args.systems]}
        engines = {}
        started_conditions = conditions(args.repeats)
        for system, folder in folders.items():
            if system not in wanted:
                continue
            start = time.perf_counter()
            engines[system] = LLM(model=str(folder), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
            results["systems"][system] = {"start_s": time.perf_counter() - start}
        for system, rates in interleaved_rates(engines, args).items():
            results["systems"][system]["tokens_per_s"] = rates
        results["conditions"] = {"start": started_conditions, "end": conditions(args.repeats)}
        if args.profile:
            results["profile"] = profile_engines(engines, args, args.profile)
        for engine in engines.values():
            engine.llm_engine.engine_core.shutdown()
        engines.clear()
        gc.collect()
    base = results["systems"]["base"]["tokens_per_s"]
    rows = [
        [
            system,
            f"{values['start_s']:.0f}",
            *[
                f"{rate:.1f} ({rate / base[batch][clock]:.2f}×)"
                for clock in ("wall", "cpu")
                for batch in args.batches
                for rate in [values["tokens_per_s"][batch][clock]]
            ],
        ]
        for system, values in results["systems"].items()
    ]
    print(
        markdown_table(
            [
                "system",
                "engine start (s)",
                *[f"tokens/s at batch {batch} (× base)" for batch in args.batches],
                *[f"tokens per CPU-s at batch {batch} (× base)" for batch in args.batches],
            ],
            rows,
        )
    )
    start, end = results["conditions"]["start"], results["conditions"]["end"]
    print(conditions_line(start, end) + ", the systems interleaved")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
