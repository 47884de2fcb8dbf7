"""lm-eval `generate_until` throughput: our `composed` model against lm-eval's `hf` on the base alone.

The model is benchmarks.decode's (a seeded random Llama and two random rank-16 LoRA experts on
every linear layer), saved to a temporary folder with a character tokenizer of the same
vocabulary (`mergecompose.analysis.data.char_tokenizer`: 4 special tokens, then one character per id). The
task is a tiny local lm-eval `generate_until` task: `--prompts` prompts of `--prompt-length`
random tokens, `max_gen_toks` = `--new-tokens`, greedy, and a stop string that never occurs, so
every row generates the full length unless it draws EOS.

  hf        lm-eval's own `hf` model on the base alone
  composed  our `composed` model (composition/lm_eval.py): the base and both experts

Timing: each lm-eval model object is built once per batch size (loading is not timed) and passed
as `model=` to `simple_evaluate`; one warm-up each, then `--repeats` rounds in which each system
runs `simple_evaluate` once (interleaved); the median per system. Tokens are those actually
generated (each response re-tokenized), so a row that stops at EOS counts what it made.

With `--model DIR` (and `--expert DIR…`, benchmarks/real_model.py) the base and experts are those
checkpoints instead, with the base's own tokenizer; the prompts are random token ids decoded to text.

    python -m benchmarks.lm_eval               # decode's default model, batch 1 and 8
    python -m benchmarks.lm_eval --model smollm2-135m-instruct --prompts 4 --prompt-length 64 --repeats 3 --threads 2
    python -m benchmarks.lm_eval --smoke       # tiny sizes, one repeat (CI smoke run)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import lm_eval
import torch
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

import mergecompose.integrations.lm_eval.harness_model  # noqa: F401  (registers `composed` with lm-eval)
from benchmarks.decode import Workbench, _sync, add_workload_arguments
from benchmarks.real_model import add_model_arguments, real_workload
from benchmarks.report import conditions, conditions_line, write_results
from mergecompose.analysis.data import SPECIAL_TOKENS, char_tokenizer
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import random_lora_adapter

SYSTEMS = ["hf", "composed"]
TASK = "throughput_generate_until"
# The stop string: ten vocabulary characters in a row, which practically never come out of these
# models (the token count would show it), so both systems generate full length.
NEVER = "zyxwvutsrq"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)  # decode's model, adapters and prompt sizes
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16, help="documents in the task")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat, to prove it runs")
    parser.add_argument("--out", default="benchmarks/results/lm_eval.json")
    return parser


def apply_smoke(args) -> None:
    args.hidden, args.layers, args.heads, args.intermediate, args.vocab = 32, 2, 4, 64, 64
    args.rank, args.prompt_length, args.new_tokens, args.prompts, args.repeats = 4, 8, 8, 4, 1
    args.batch_sizes = [1, 2]


def benchmark_characters(count: int) -> str:
    """`count` distinct non-space characters: ASCII letters and digits, then CJK ideographs.

    transformers' `StopStringCriteria` (which `ComposedLM.generate` runs for lm-eval's stop
    strings) reads every token's text by encoding "abcdef" before it, so those letters must be
    tokens; a word-level vocabulary ("w4" … "w8191") cannot encode it and fails there.
    """
    ascii_characters = string.ascii_letters + string.digits
    return (ascii_characters + "".join(chr(0x4E00 + index) for index in range(max(0, count - len(ascii_characters)))))[
        :count
    ]


def save_checkpoints(args, folder: Path) -> tuple[Path, list[Path], int]:
    """decode's base (with its tokenizer) and its two LoRA experts, saved under `folder`; and the parameter count."""
    args.arch, args.lora_implementation = "llama", "stacked"  # what Workbench reads besides our flags
    base = Workbench(args, ["base"]).base
    # decode turns EOS off to fix its token count; here EOS stays on, as in a real checkpoint.
    base.generation_config.eos_token_id = base.config.eos_token_id
    base.save_pretrained(folder / "base")
    # <pad>, <s>, </s>, <unk> at ids 0–3 (the config's pad 0, bos 1, eos 2), one character per id after.
    char_tokenizer(benchmark_characters(base.config.vocab_size - len(SPECIAL_TOKENS))).save_pretrained(folder / "base")
    # The seeds, scale and rank of decode's Workbench, so the experts are decode's.
    experts = [
        random_lora_adapter(base, folder / f"expert_{index}", seed=10 + index, rank=args.rank, scale=0.05)
        for index in range(2)
    ]
    return folder / "base", experts, base.num_parameters()


def write_task(args, folder: Path, tokenizer) -> Path:
    """A `generate_until` task of `args.prompts` random prompts in `folder`; returns the include path."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        len(SPECIAL_TOKENS), tokenizer.vocab_size, (args.prompts, args.prompt_length), generator=generator
    )
    rows = [{"text": tokenizer.decode(row, skip_special_tokens=True), "target": ""} for row in ids.tolist()]
    data = folder / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    tasks = folder / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data.resolve()}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{text}}"\ndoc_to_target: target\n'
        f'generation_kwargs:\n  until: ["{NEVER}"]\n  max_gen_toks: {args.new_tokens}\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return tasks


def build_models(args, base: Path, experts: list[Path], batch: int) -> dict:
    """One lm-eval model object per system, built (and loaded) once for `batch`."""
    model_args = {  # the device comes with the batch size, as lm-eval's own CLI passes them
        "hf": {"pretrained": str(base), "dtype": args.dtype},
        "composed": {"base": str(base), "experts": [str(path) for path in experts], "dtype": args.dtype},
    }
    return {
        name: get_model(name).create_from_arg_obj(model_args[name], {"batch_size": batch, "device": args.device})
        for name in SYSTEMS
    }


def evaluate(model, task_manager: TaskManager, tokenizer) -> tuple[float, int]:
    """Seconds of one `simple_evaluate` of the task with `model`, and the tokens it generated."""
    _sync(model.device)
    start = time.perf_counter()
    output = lm_eval.simple_evaluate(
        model=model,
        tasks=[TASK],
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    _sync(model.device)
    seconds = time.perf_counter() - start
    responses = [sample["resps"][0][0] for sample in output["samples"][TASK]]
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in responses)
    return seconds, tokens


def time_systems(models: dict, task_manager: TaskManager, tokenizer, repeats: int) -> dict[str, dict]:
    """Median seconds per `simple_evaluate` of each system, interleaved, after one warm-up each; tokens made."""
    for model in models.values():
        evaluate(model, task_manager, tokenizer)
    seconds = {name: [] for name in models}
    tokens = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            elapsed, made = evaluate(model, task_manager, tokenizer)
            seconds[name].append(elapsed)
            tokens[name].append(made)
    rows = {}
    for name in models:
        if len(set(tokens[name])) != 1:
            raise RuntimeError(f"{name} made a different number of tokens in each greedy run: {tokens[name]}")
        median = statistics.median(seconds[name])
        rows[name] = {
            "seconds": median,
            "tokens": tokens[name][0],
            "tokens_per_second": tokens[name][0] / median,
            "all_seconds": seconds[name],
        }
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        apply_smoke(args)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        if args.model:
            base_source, expert_sources = real_workload(args.model, args.expert)
            base, experts = Path(base_source), [Path(source) for source in expert_sources]
            parameters = None  # not loaded here: lm-eval's models load the checkpoints
        else:
            base, experts, parameters = save_checkpoints(args, folder)
        tokenizer = AutoTokenizer.from_pretrained(base)
        started = conditions(args.repeats)
        task_manager = TaskManager(include_path=str(write_task(args, folder, tokenizer)), include_defaults=False)
        results = {
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "device": args.device,
            "dtype": args.dtype,
            "parameters": parameters,
            "lm_eval": lm_eval.__version__,
            "args": vars(args),
            "batches": {},
        }
        size = (
            f"{parameters / 1e6:.1f} M parameters"
            if parameters
            else f"{args.model}, experts {args.expert or 'trained'}"
        )
        print(
            f"lm-eval generate_until benchmark: {size}, {args.dtype} on {args.device}, "
            f"{args.prompts} prompts of {args.prompt_length} tokens, up to {args.new_tokens} new tokens, "
            f"median of {args.repeats}"
        )
        for batch in args.batch_sizes:
            models = build_models(args, base, experts, batch)
            rows = time_systems(models, task_manager, tokenizer, args.repeats)
            del models
            for name in rows:
                rows[name]["ratio_to_hf"] = rows[name]["tokens_per_second"] / rows["hf"]["tokens_per_second"]
            results["batches"][str(batch)] = rows
        results["conditions"] = {"start": started, "end": conditions(args.repeats)}
    print_table(results)
    print(conditions_line(started, results["conditions"]["end"]))
    write_results(results, args.out)
    return 0


def print_table(results) -> None:
    names = {"hf": "lm-eval `hf`, base alone", "composed": "`composed`, base + 2 LoRA experts"}
    rows = [
        [
            names[name],
            batch,
            row["tokens"],
            f"{row['seconds']:.2f}",
            f"{row['tokens_per_second']:.1f}",
            f"{row['ratio_to_hf']:.3f}",
        ]
        for batch, batch_rows in results["batches"].items()
        for name, row in batch_rows.items()
    ]
    print(markdown_table(["system", "batch", "tokens", "seconds", "tokens/s", "ratio to hf"], rows, pad=True))


if __name__ == "__main__":
    sys.exit(main())
