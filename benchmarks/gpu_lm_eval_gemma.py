"""A `type: lm_eval` compare at Gemma-2-2B's size: random checkpoints, tiny local tasks, wall time and GPU memory.

It proves that the pipeline runs at that size (bf16 on one GPU); it says nothing of accuracy (the
weights are random). Nothing is downloaded: every model, the tokenizer and the tasks are made here.

  base         a seeded random Gemma2 with google/gemma-2-2b's shape (benchmarks.decode's config:
               vocab 256000, hidden 2304, 26 layers, 8 heads / 4 KV heads of 256, MLP 9216)
  expert:a/b   full checkpoints: the base plus small seeded Gaussian noise (`--noise`, absolute)
  compose      `composed`: the base and both full experts, one KV cache each
  merge:task_arithmetic
               λ = 1, `--merge paper` (default: `merge_definitions: paper`, `mergecompose.merging.merge` in memory
               on the host, then saved), `--merge mergekit` (mergekit's `merge_checkpoints`, run on
               the compare's device) or `--merge none`

The tokenizer (`mergecompose.analysis.data.char_tokenizer`) has one character per id: <pad>, <eos>, <bos>, <unk>
at Gemma's ids 0–3, then ASCII letters, digits, space, then code points from U+4E00 on (no
surrogates). A word-level vocabulary does not do: transformers' `StopStringCriteria`, which the
composed model runs for lm-eval's stop strings, reads every token's text through the tokenizer
and needs ASCII letters as tokens.

Tasks (`dataset_path: json`, absolute `data_files`):
  gemma_rand_gen     generate_until, `--prompts` prompts of `--prompt-tokens` random tokens,
                     greedy, `--max-gen-toks`, and a stop string that never comes, so every row
                     generates the full length unless it draws <eos>
  gemma_rand_choice  multiple_choice: the same kind of prompts, 4 choices of 8 random tokens

The compare (`mergecompose.experiments.compare.run_compare` on the YAML this script writes; device, dtype, batch
size as given) runs with torch's own thread count, in `WORK/run_<merge>`. Reported: wall seconds
of the checkpoint build and of the compare (with its own stage timings), each system's seconds
and peak GPU memory (`torch.cuda.max_memory_allocated`, reset when the system's model is loaded),
the peak over the whole compare, nvidia-smi's largest used memory (polled every 0.2 s, where it
exists), the host's peak RSS, and the results table. results_<merge>.json, results_<merge>.md
and summary_<merge>.json are copied into `$OUT` (or `--copy-to`).

With `--work DIR`, a second run with another `--merge` reuses the checkpoints (same settings) and
the first run's cells (base, experts, compositions: same keys), so it evaluates only the merge:

    python -m benchmarks.gpu_lm_eval_gemma                     # cuda, bfloat16, full size, paper merge
    python -m benchmarks.gpu_lm_eval_gemma --merge mergekit --work /tmp/g && \
        python -m benchmarks.gpu_lm_eval_gemma --merge paper --work /tmp/g   # both merges, one build
    HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m benchmarks.gpu_lm_eval_gemma --tiny   # CPU, float32, tiny Gemma2

The figures measured on one H200 are in benchmarks/README.md ("lm-eval compare at Gemma-2-2B's size").
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval
import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM, Gemma2Config, PreTrainedTokenizerFast

from benchmarks.shapes import gemma2_2b_config
from mergecompose.analysis.data import char_tokenizer
from mergecompose.experiments.compare import run_compare
from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.lm_eval import lm_eval_compare

GEMMA_SPECIAL_TOKENS = {
    "pad_token": "<pad>",
    "eos_token": "<eos>",
    "bos_token": "<bos>",
    "unk_token": "<unk>",
}  # ids 0, 1, 2, 3
ASCII = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
NEVER = "zyxwvutsrq"  # the stop string: ten given ASCII characters in a row practically never come out
GENERATE_TASK, CHOICE_TASK = "gemma_rand_gen", "gemma_rand_choice"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny Gemma2 on the CPU in float32 (to test the script)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16, or float32 with --tiny",
    )
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--noise", type=float, default=0.002, help="std of the experts' Gaussian perturbation")
    parser.add_argument("--merge", default="paper", choices=["paper", "mergekit", "none"])
    parser.add_argument(
        "--work", default=None, help="folder for checkpoints, tasks and the run (default: a temporary one, deleted)"
    )
    parser.add_argument(
        "--copy-to", default=os.environ.get("OUT"), help="copy results.json/.md and summary.json here (default: $OUT)"
    )
    return parser


def model_config(args) -> Gemma2Config:
    if args.tiny:
        config = Gemma2Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=512,
            sliding_window=256,
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
            initializer_range=0.02,
        )
    else:
        config = gemma2_2b_config()
    if args.vocab is not None:
        config.vocab_size = args.vocab
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        config.layer_types = config.layer_types[: args.layers]
    return config


def characters(count: int) -> str:
    """`count` distinct characters: ASCII letters, digits and space, then code points from U+4E00 on, surrogates
    skipped."""
    extra, code = [], 0x4E00
    while len(ASCII) + len(extra) < count:
        if not 0xD800 <= code <= 0xDFFF:
            extra.append(chr(code))
        code += 1
    return (ASCII + "".join(extra))[:count]


def build_checkpoints(args, config: Gemma2Config, folder: Path) -> dict:
    """Base and two experts saved under `folder`, built on the device in the run's dtype; paths and timings."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokenizer = char_tokenizer(characters(config.vocab_size - len(GEMMA_SPECIAL_TOKENS)), GEMMA_SPECIAL_TOKENS)
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1 and tokenizer.bos_token_id == 2
    assert len(tokenizer) == config.vocab_size
    started = time.perf_counter()
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            base = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    base.eval()
    _sync(device)
    timings = {"base_init": time.perf_counter() - started}
    paths = {}

    stage = time.perf_counter()
    base.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    paths["base"] = folder / "base"
    timings["base_save"] = time.perf_counter() - stage
    for index, name in enumerate(["a", "b"]):
        stage = time.perf_counter()
        expert = copy.deepcopy(base)
        generator = torch.Generator(device=device).manual_seed(100 + index)
        with torch.no_grad():
            for parameter in expert.parameters():
                parameter.add_(
                    torch.randn(parameter.shape, generator=generator, device=device, dtype=dtype), alpha=args.noise
                )
        expert.save_pretrained(folder / f"expert_{name}")
        tokenizer.save_pretrained(folder / f"expert_{name}")
        paths[name] = folder / f"expert_{name}"
        del expert
        _sync(device)
        timings[f"expert_{name}"] = time.perf_counter() - stage
    parameters = base.num_parameters()
    del base
    _free(device)
    return {
        "paths": paths,
        "tokenizer": tokenizer,
        "parameters": parameters,
        "timings": {key: round(value, 2) for key, value in timings.items()},
    }


def write_tasks(args, folder: Path, tokenizer) -> Path:
    """The two tiny lm-eval tasks in `folder/tasks`; returns that folder (lm-eval's include_path)."""
    tasks = folder / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    low, high = len(GEMMA_SPECIAL_TOKENS), len(tokenizer)

    def text(length: int) -> str:
        return tokenizer.decode(torch.randint(low, high, (length,), generator=generator).tolist())

    generate = [{"prompt": text(args.prompt_tokens), "target": text(8)} for _ in range(args.prompts)]
    choice = [
        {"prompt": text(args.prompt_tokens), "choices": [text(8) for _ in range(4)], "label": index % 4}
        for index in range(args.prompts)
    ]
    for name, rows in ((GENERATE_TASK, generate), (CHOICE_TASK, choice)):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
        )
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "prompt", "target_delimiter": " "}
    configs = {
        GENERATE_TASK: {
            "output_type": "generate_until",
            "doc_to_target": "target",
            "generation_kwargs": {"until": [NEVER], "max_gen_toks": args.max_gen_toks, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
        CHOICE_TASK: {
            "output_type": "multiple_choice",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
    }
    for name, config in configs.items():
        task = {
            "task": name,
            **common,
            "dataset_kwargs": {"data_files": {"test": str((folder / f"{name}.jsonl").resolve())}},
            **config,
            "metadata": {"version": 1.0},
        }
        (tasks / f"{name}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return tasks


def compare_config(args, paths: dict, tasks: Path) -> dict:
    config = {
        "name": "gemma2_2b_random_lm_eval" if not args.tiny else "gemma2_tiny_random_lm_eval",
        "task": {"type": "lm_eval", "names": [GENERATE_TASK, CHOICE_TASK], "include_path": str(tasks.resolve())},
        "base": str(paths["base"].resolve()),
        "experts": {"a": str(paths["a"].resolve()), "b": str(paths["b"].resolve())},
        "compositions": {"compose": {"experts": ["a", "b"]}},
        "batch_size": args.batch_size,
        "device": args.device,
        "dtype": args.dtype,
    }
    if args.merge != "none":
        config["merges"] = {"task_arithmetic": {"lam": [1.0]}}
        config["merge_definitions"] = args.merge
    return config


class GpuPoller:
    """nvidia-smi's used memory of the GPU, polled every `interval` seconds; `peak_mib` the largest seen (None
    without it)."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak_mib, self.error = interval, None, None
        self._stop = threading.Event()
        self._thread = None
        self.command = shutil.which("nvidia-smi")

    def _read(self) -> int | None:
        output = subprocess.run(
            [self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return max(int(line) for line in output.split())

    def _loop(self):
        while not self._stop.is_set():
            try:
                used = self._read()
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)
            except Exception as error:  # noqa: BLE001  (a failed poll is reported, not fatal)
                self.error = repr(error)
                return
            self._stop.wait(self.interval)

    def __enter__(self):
        if self.command is not None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


class PeakMemory:
    """The peak GPU memory over a stretch in which `torch.cuda.reset_peak_memory_stats` is called (per system)."""

    def __init__(self, device: torch.device):
        self.device, self.allocated, self.reserved = device, 0, 0

    def fold(self) -> None:
        """Fold the peaks since the last reset in (call before every reset, and at the end)."""
        if self.device.type == "cuda":
            self.allocated = max(self.allocated, torch.cuda.max_memory_allocated(self.device))
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))

    def reset(self) -> None:
        self.fold()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def measure_systems(device: torch.device, peak: PeakMemory) -> dict:
    """Wrap the lm_eval compare's model loader: each system's wall seconds (load and cells) and peak GPU memory."""
    records = {}
    original_enter, original_exit = lm_eval_compare._Loader.__enter__, lm_eval_compare._Loader.__exit__

    def enter(self):
        _sync(device)
        peak.reset()  # the merges stage's peak (before the first system) is folded in too
        self._benchmark_started = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {self.system.name}: evaluating", flush=True)
        return original_enter(self)

    def exit_(self, *exc_info):
        loaded = self.model is not None
        _sync(device)
        record = {"wall_s": round(time.perf_counter() - self._benchmark_started, 2), "loaded": loaded}
        if device.type == "cuda":
            record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        records[self.system.name] = record
        print(f"[{time.strftime('%H:%M:%S')}] {self.system.name}: done {record}", flush=True)
        return original_exit(self, *exc_info)

    lm_eval_compare._Loader.__enter__, lm_eval_compare._Loader.__exit__ = enter, exit_
    return records


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (use --tiny for the CPU check)")

    config = model_config(args)
    temporary = args.work is None
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_lm_eval_gemma-"))
    work.mkdir(parents=True, exist_ok=True)
    summary = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lm_eval": lm_eval.__version__,
            "transformers": transformers.__version__,
            "cpu_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "device": args.device,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "merge": args.merge,
        "tasks": {
            GENERATE_TASK: {
                "prompts": args.prompts,
                "prompt_tokens": args.prompt_tokens,
                "max_gen_toks": args.max_gen_toks,
            },
            CHOICE_TASK: {
                "prompts": args.prompts,
                "prompt_tokens": args.prompt_tokens,
                "choices": 4,
                "choice_tokens": 8,
            },
        },
        "model": {
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
        },
    }
    started = time.perf_counter()
    try:
        with GpuPoller() if device.type == "cuda" else _Nothing() as poller:
            stage = time.perf_counter()
            built = checkpoints(args, config, work / "checkpoints")
            summary["model"]["parameters"] = built["parameters"]
            summary["build"] = {"wall_s": round(time.perf_counter() - stage, 2), **built["timings"]}
            if device.type == "cuda":
                summary["build"]["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                torch.cuda.reset_peak_memory_stats(device)
            size = sum(path.stat().st_size for path in (work / "checkpoints" / "base").glob("*.safetensors"))
            summary["model"]["checkpoint_gib"] = round(size / 2**30, 2)
            print(
                f"checkpoints: {built['parameters'] / 1e6:.1f} M parameters, {size / 2**30:.2f} GiB each, "
                f"{'reused' if built['reused'] else 'built and saved'} in {summary['build']['wall_s']} s",
                flush=True,
            )

            tasks = write_tasks(args, work, built["tokenizer"])
            config_path = work / f"compare_{args.merge}.yaml"
            config_path.write_text(yaml.safe_dump(compare_config(args, built["paths"], tasks), sort_keys=False))
            run_dir = work / f"run_{args.merge}"
            summary["cells_copied_from"] = copy_cells(work, run_dir)
            peak = PeakMemory(device)
            systems = measure_systems(device, peak)
            stage = time.perf_counter()
            compare = load_config(config_path)
            summary["config_check_s"] = round(time.perf_counter() - stage, 2)
            stage = time.perf_counter()
            results = run_compare(compare, run_dir, progress=False, threads=None)
            _sync(device)
            summary["compare"] = {
                "wall_s": round(time.perf_counter() - stage, 2),
                "stages": results["timings"],
                "cells_evaluated": len(results["cells"]["evaluated"]),
                "cells_reused": len(results["cells"]["reused"]),
            }
            if device.type == "cuda":
                peak.fold()  # the largest of every system's peak and the merges stage's
                summary["compare"]["peak_allocated_gib"] = round(peak.allocated / 2**30, 2)
                summary["compare"]["peak_reserved_gib"] = round(peak.reserved / 2**30, 2)
        summary["wall_s"] = round(time.perf_counter() - started, 2)
        summary["host_peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        if poller.peak_mib is not None or poller.error is not None:
            summary["nvidia_smi"] = {"peak_used_mib": poller.peak_mib, "error": poller.error}
        summary["systems"] = {
            name: {"model": record["model"], "cells_s": record["seconds"], **systems.get(name, {"reused": True})}
            for name, record in results["systems"].items()
        }
        summary["results"] = {
            name: {split: round(cell["value"], 4) for split, cell in record["splits"].items()}
            for name, record in results["systems"].items()
        }
        summary["merges"] = {method: record["chosen"] for method, record in results["merges"].items()}
        print("\nsummary:\n" + json.dumps(summary, indent=1), flush=True)
        if args.copy_to:
            target = Path(args.copy_to)
            target.mkdir(parents=True, exist_ok=True)
            for name in ("results.json", "results.md"):
                shutil.copy(run_dir / name, target / name.replace("results", f"results_{args.merge}"))
            (target / f"summary_{args.merge}.json").write_text(json.dumps(summary, indent=1))
            print(f"copied results_{args.merge}.json, results_{args.merge}.md, summary_{args.merge}.json to {target}")
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def checkpoints(args, config: Gemma2Config, folder: Path) -> dict:
    """The checkpoints under `folder`: reused when an earlier run of the same settings left them, else built."""
    settings = {"config": config.to_dict(), "noise": args.noise, "dtype": args.dtype}
    marker = folder / "settings.json"
    names = {"base": "base", "a": "expert_a", "b": "expert_b"}
    if marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(settings)):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder / "base"))
        parameters = json.loads((folder / "parameters.json").read_text())
        return {
            "paths": {key: folder / name for key, name in names.items()},
            "tokenizer": tokenizer,
            "parameters": parameters,
            "timings": {},
            "reused": True,
        }
    if folder.exists():
        shutil.rmtree(folder)
    built = build_checkpoints(args, config, folder)
    (folder / "parameters.json").write_text(json.dumps(built["parameters"]))
    marker.write_text(json.dumps(settings))
    return {**built, "reused": False}


def copy_cells(work: Path, run_dir: Path) -> str | None:
    """Before a first run in `run_dir`: the cells of another run under `work` (base, experts, compositions are
    reused by key)."""
    if run_dir.exists():
        return None
    for other in sorted(work.glob("run_*")):
        if (other / "cells").is_dir():
            shutil.copytree(other / "cells", run_dir / "cells")
            if (other / "samples").is_dir():
                shutil.copytree(other / "samples", run_dir / "samples")
            return other.name
    return None


class _Nothing:
    peak_mib = error = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
