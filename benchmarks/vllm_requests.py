"""Per-request experts in vLLM, on the CPU: a batch whose requests choose different compositions against one whose
requests all get the same, in one engine, as ratios of tokens/s.

Run in the vLLM environment (`make install-vllm`):

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m benchmarks.vllm_requests

One composite folder of a base and two experts (`--kind lora`, the default, or `full`; the models of
benchmarks/vllm_throughput.py: a random Llama, hidden 256, 4 layers, or `--model DIR|NAME` with its adapters), one
engine. Three mixes of requests (`vllm_xargs`, integrations/vllm/choice.py) decode the same prompts:

* `folder`: no request names experts; every one gets the folder's composition (both experts, weight 1);
* `same, chosen`: every request names both experts at the folder's weights (the same composition, through each
  request's own row of weights);
* `mixed`: the requests take turns: the base alone, the first expert alone, both experts.

Each batch of prompts (length 16) decodes `--new-tokens` tokens greedily, EOS ignored, after one warm-up batch
of each mix; `--repeats` rounds time one batch of every mix in turn (interleaved), and each figure is the median of
its rounds. The ratios are against `folder`, by the clock and per CPU-second of this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.real_model import add_model_arguments
from benchmarks.report import conditions, conditions_line, write_results
from benchmarks.vllm_throughput import prompts_and_params, save_models, save_real_models, time_batch
from mergecompose.core.io import markdown_table

FOLDERS = {"lora": "composed, 2 LoRA experts", "full": "composed, 2 full experts"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=sorted(FOLDERS), default="lora", help="the experts: LoRA adapters or full")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4, help="head_dim = hidden / heads must be >= 32 on the CPU")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[16])
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds; each figure is their median")
    parser.add_argument("--out", default="benchmarks/results/vllm_requests.json")
    add_model_arguments(parser)
    return parser


def request_mixes(names: list[str], batch: int) -> dict[str, list[dict | None]]:
    """{mix: each request's `extra_args`} for `batch` requests of a folder whose experts are `names`."""
    first, second = names
    turns = [{"experts": ""}, {"experts": first}, {"experts": f"{first},{second}"}]
    return {
        "folder": [None] * batch,
        "same, chosen": [{"experts": f"{first},{second}", "weights": "1,1"}] * batch,
        "mixed": [turns[index % len(turns)] for index in range(batch)],
    }


def _with_extra_args(params, extra_args: dict | None):
    """A copy of vLLM's `SamplingParams` with these `extra_args`."""
    copy = params.clone()
    copy.extra_args = extra_args
    return copy


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM  # after the environment above, which vLLM reads at import

    results: dict = {"settings": vars(args), "mixes": {}}
    with tempfile.TemporaryDirectory() as temporary:
        folders = save_real_models(args, Path(temporary)) if args.model else save_models(args, Path(temporary))
        folder = folders[FOLDERS[args.kind]]
        composition = json.loads((folder / "config.json").read_text())["composition"]
        names = [expert["name"] for expert in composition["experts"]]
        results["conditions"] = {"start": conditions(args.repeats)}
        start = time.perf_counter()
        engine = LLM(model=str(folder), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
        results["engine_start_s"] = time.perf_counter() - start
        for batch in args.batches:
            prompts, shared = prompts_and_params(args, batch)
            params = {
                mix: [_with_extra_args(shared, chosen) for chosen in mix_args]
                for mix, mix_args in request_mixes(names, batch).items()
            }
            for mix_params in params.values():
                engine.generate(prompts, mix_params, use_tqdm=False)  # warm-up
            runs: dict[str, list[dict[str, float]]] = {mix: [] for mix in params}
            for _ in range(args.repeats):
                for mix in params:
                    runs[mix].append(time_batch(engine, prompts, params[mix]))
            for mix, timed in runs.items():
                results["mixes"].setdefault(mix, {})[batch] = {
                    clock: statistics.median(run["tokens"] / run[clock] for run in timed) for clock in ("wall", "cpu")
                }
                results.setdefault("rounds", {}).setdefault(mix, {})[batch] = timed  # every round, for the spread
        results["conditions"]["end"] = conditions(args.repeats)
        engine.llm_engine.engine_core.shutdown()
    folder_rates = results["mixes"]["folder"]
    rows = [
        [
            mix,
            *[
                f"{rate:.1f} ({rate / folder_rates[batch][clock]:.2f}×)"
                for clock in ("wall", "cpu")
                for batch in args.batches
                for rate in [rates[batch][clock]]
            ],
        ]
        for mix, rates in results["mixes"].items()
    ]
    print(
        markdown_table(
            [
                f"requests ({FOLDERS[args.kind]})",
                *[f"tokens/s at batch {batch} (× folder)" for batch in args.batches],
                *[f"tokens per CPU-s at batch {batch} (× folder)" for batch in args.batches],
            ],
            rows,
        )
    )
    print(conditions_line(results["conditions"]["start"], results["conditions"]["end"]) + ", the mixes interleaved")
    write_results(results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
