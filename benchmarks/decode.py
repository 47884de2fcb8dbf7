"""Composed decoding against the base alone, side by side in one process.

Systems, all greedy, same prompts, same number of new tokens (EOS disabled):
  (a) base    the base alone with transformers' `generate`
  (a') kernels   the base alone with `generate`, its linears given the composition's kernels: packed by oneDNN if
              the LoRA composition's timing at load packed its base (if `lora` is not run, if the base's own timing
              packs), dense otherwise (`FewRowLinears`); (c) against it is the composition's own overhead
  (b) full    ComposedLM with two full expert models (one KV cache each)
  (c) lora    ComposedLM.from_adapters: two LoRA experts on one shared base, one batched pass
  (d) naive   re-runs base and both experts on the whole prefix every step (as DExperts does)
  (e) full+spec   (b) with speculative decoding, the task-arithmetic merge of its experts as the draft
  (f) lora+spec   (c) likewise (it warns: composing LoRA experts already costs about one base pass)

(e) and (f) are also reported against the composition they speed up, with their acceptance rate a
and the speed-up 3·E/(K+3), E = (1 − a^(K+1))/(1 − a), that a draft pass costing a third of a
composed step would give.

Models: seeded random ones (the Llama sized by the flags, or `--arch gemma2-2b`), whose LoRA
experts are small random updates; or, with `--model DIR` (and `--expert DIR…`), a real base and its
experts (benchmarks/real_model.py: without `--expert`, two LoRA adapters of rank 8 trained here for a
few steps), prompts of random token ids or, with `--prompts math`, the study's math word problems as
chat prompts; or, with `--letters RUN_DIR`, the trained letters models of a `mergecompose compare` run
(its cached checkpoints, trained first if missing): coupled positions, held-out strings of the joint
split, each string's L characters and EOS generated.

Timing: one warm-up, then `--repeats` rounds in which every system runs once (interleaved);
the median per system is reported as tokens/s and as a ratio to (a). Peak resident memory is
measured for each system in its own fresh subprocess (VmHWM, see benchmarks.memory), `--memory-repeats` times
interleaved over the systems; the median is reported (one process's peak moved by about 1 % between runs).

    python -m benchmarks.decode                   # ~28 M-parameter Llama, batch 1 and 8
    python -m benchmarks.decode --systems base full full+spec --batch-sizes 1 --no-memory
    python -m benchmarks.decode --letters runs/letters --systems base full full+spec lora lora+spec --batch-sizes 1
    python -m benchmarks.decode --model smollm2-135m-instruct --prompt-length 64 --threads 2   # `make bench`
    python -m benchmarks.decode --model smollm2-135m-instruct --expert MATH CODE --prompts math \
        --systems full full+spec --batch-sizes 1 --no-memory   # full experts, the merged draft, math prompts
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

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.memory import peak_rss_mib
from benchmarks.real_model import add_model_arguments, real_workload
from benchmarks.report import conditions, conditions_line, profile_table, write_results
from benchmarks.shapes import gemma2_2b_config
from mergecompose.composition import ComposedLM, SpeculationStats, compose_logprobs
from mergecompose.composition.kernels.few_row_linear import FewRowLinears
from mergecompose.core.boundary import check_model_or_adapter
from mergecompose.core.io import markdown_table
from mergecompose.core.tiny import ALL_LINEAR, tiny_llama_config
from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.tokenizer import encode_strings
from mergecompose.experiments.trained_models import prepare_components
from mergecompose.experiments.training_strings import is_held_out
from mergecompose.studies.letters.task import sample_strings
from mergecompose.studies.math_code.chat_data import generation_inputs
from mergecompose.studies.math_code.math_problems import math_split

SYSTEMS = ["base", "kernels", "full", "lora", "naive"]
# Speculative systems -> the composition each one speeds up.
SPECULATIVE = {"full+spec": "full", "lora+spec": "lora"}
NAMES = {
    "base": "(a) base generate",
    "kernels": "(a') base, same kernels",
    "full": "(b) composed, full",
    "lora": "(c) composed, LoRA",
    "naive": "(d) naive re-run",
    "full+spec": "(e) full + merged draft",
    "lora+spec": "(f) LoRA + merged draft",
}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's size, the adapters' rank, the prompts and the repeats: shared with `benchmarks.lm_eval`."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--expert-scale",
        type=float,
        default=0.05,
        help="random LoRA factors are multiplied by this (larger: experts farther from the base, a poorer merge)",
    )
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "gemma2-2b"],
        help="llama: sized by the flags below; gemma2-2b: a random Gemma-2-2B-shaped model",
    )
    add_workload_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument(
        "--prompts",
        default="random",
        choices=["random", "math"],
        help="with --model: prompts of --prompt-length random ids, or the math test split's first --math-prompts "
        "word problems as chat prompts (the study's rendering, left-padded in a batch)",
    )
    parser.add_argument("--math-prompts", type=int, default=4, help="how many math problems (--prompts math)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS + list(SPECULATIVE))
    parser.add_argument("--draft-tokens", type=int, default=4, help="K, tokens drafted a round by (e) and (f)")
    parser.add_argument(
        "--fixed-draft",
        action="store_true",
        help="K fixed at --draft-tokens every round (adaptive_draft=False); default: the adaptive K",
    )
    parser.add_argument(
        "--draft-lambda",
        type=float,
        nargs="+",
        default=None,
        help="λ_i of the merged draft (default: the composition's weights, 1.0 each)",
    )
    parser.add_argument(
        "--letters",
        default=None,
        metavar="RUN_DIR",
        help="the trained letters models of this compare run folder (its config.yaml and checkpoints/)",
    )
    parser.add_argument("--letters-strings", type=int, default=16, help="held-out joint strings per run (--letters)")
    parser.add_argument("--letters-length", type=int, default=16, help="their length L; L + 1 tokens are generated")
    parser.add_argument("--lora-implementation", default="stacked", choices=["stacked", "peft"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-system memory subprocesses")
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="fresh processes per system for peak memory, interleaved over the systems; the median is reported",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timings, run each system once at the first batch size under torch.profiler and print its "
        "N most expensive operators (self CPU time)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one repeat, to prove it runs")
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return parser


def apply_smoke(args) -> None:
    args.hidden, args.layers, args.heads, args.intermediate, args.vocab = 32, 2, 4, 64, 64
    args.rank, args.prompt_length, args.new_tokens, args.repeats, args.memory_repeats = 4, 8, 8, 1, 1
    args.batch_sizes = [1, 2]


def model_config(args):
    """The benchmark model's config: a Llama sized by the flags, or a Gemma-2-2B shape."""

    if args.arch == "gemma2-2b":
        return gemma2_2b_config()
    return tiny_llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate,
        initializer_range=0.02,
    )


class Workbench:
    """The models for every system, built once: seeded random ones, or (`--letters`) trained letters models.

    `systems[name](prompt)` decodes one prompt batch (a dict of `generate` inputs); `prompts(batch)`
    is the list of prompt batches one timed run decodes; `new_tokens` tokens are made per row.
    """

    def __init__(self, args, systems):
        self.args = args
        self.device = torch.device(args.device)
        self.speculation: dict[str, list[SpeculationStats]] = {name: [] for name in SPECULATIVE}
        if getattr(args, "letters", None):
            fresh_base, full_experts, adapters = self._letters_models(args)
        elif getattr(args, "model", None):
            fresh_base, full_experts, adapters = self._real_models(args, systems)
        else:
            fresh_base, full_experts, adapters = self._random_models(args)
        self.new_tokens = args.new_tokens

        self.systems = {}
        experts = full_experts() if {"full", "naive", "full+spec"} & set(systems) else []
        if {"base", "full", "naive", "full+spec"} & set(systems):
            self.base = fresh_base()
        if "base" in systems:
            self.systems["base"] = self._run_base
        if {"full", "full+spec"} & set(systems):
            # Its own copy of the base: a composition of full models replaces their linears' forwards while it is
            # open (kernels/few_row_linear.py), and (a) runs transformers' `generate` on a model left as it is.
            self.full = ComposedLM(fresh_base(), experts)
        if {"lora", "lora+spec"} & set(systems):
            self.lora = ComposedLM.from_adapters(fresh_base(), adapters, lora_implementation=args.lora_implementation)
        for name in ["full", "lora"]:
            if name in systems:
                self.systems[name] = lambda prompt, name=name: getattr(self, name).generate(**prompt, **self._decoding)
        for name, plain in SPECULATIVE.items():
            if name in systems:
                self.systems[name] = lambda prompt, name=name, plain=plain: self._speculate(
                    name, getattr(self, plain), prompt
                )
        if "kernels" in systems:
            # After the LoRA composition, whose timing at load chose packed or dense weights for its base.
            stacked = getattr(getattr(self, "lora", None), "backend", None)
            stacked = getattr(stacked, "stacked", None)  # None: no LoRA composition, or peft's
            pack = None if stacked is None else stacked.linears.packed
            self.kernels_base = fresh_base()
            linears = [(module, None) for module in self.kernels_base.modules() if type(module) is torch.nn.Linear]
            self.kernel_linears = FewRowLinears(linears, pack_model=self.kernels_base, pack=pack)
            self.systems["kernels"] = lambda prompt: self._run_base(prompt, self.kernels_base)
        if "naive" in systems:
            self.naive_models = [self.base, *experts]
            self.systems["naive"] = self._run_naive

    # ------------------------------------------------------------------ the models

    def _random_models(self, args):
        from peft import LoraConfig, PeftModel, get_peft_model

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
                        parameter.mul_(getattr(args, "expert_scale", 0.05))
            adapter_dirs.append(Path(self._folder.name) / f"expert_{index}")
            peft_model.save_pretrained(str(adapter_dirs[-1]))
            base = peft_model.unload()
        del base, peft_model

        def full_experts():
            return [
                PeftModel.from_pretrained(fresh_base(), str(folder)).merge_and_unload().eval()
                for folder in adapter_dirs
            ]

        self._decoding = {"max_new_tokens": args.new_tokens}
        self._prompt_batches = self._random_prompts
        return fresh_base, full_experts, {f"expert_{i}": str(folder) for i, folder in enumerate(adapter_dirs)}

    def _real_models(self, args, systems):
        """A real base and its experts (`--model`, `--expert`), in the benchmark's dtype; prompts of random ids, or
        (`--prompts math`) the math test split's word problems as the study renders them."""
        from peft import PeftModel

        base_dir, expert_sources = real_workload(args.model, args.expert, progress=not args.memory_child)
        kinds = [check_model_or_adapter(source, "--expert") for source in expert_sources]
        dtype = getattr(torch, args.dtype)
        self.config = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).config

        def fresh_base():
            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(self.device)
            model.generation_config.eos_token_id = None  # every run makes exactly new_tokens tokens
            model.generation_config.pad_token_id = 0
            return model.eval()

        def full_experts():
            return [
                (
                    PeftModel.from_pretrained(fresh_base(), source).merge_and_unload()
                    if kind == "adapter"
                    else AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(self.device)
                ).eval()
                for source, kind in zip(expert_sources, kinds)
            ]

        if {"lora", "lora+spec"} & set(systems) and "checkpoint" in kinds:
            raise SystemExit("--expert: the LoRA systems need adapters; leave lora and lora+spec out of --systems")
        self.parameters = fresh_base().num_parameters()
        self._decoding = {"max_new_tokens": args.new_tokens}
        self._prompt_batches = self._random_prompts
        if args.prompts == "math":
            tokenizer = AutoTokenizer.from_pretrained(base_dir)
            self.math_prompts = [problem.prompt for problem in math_split("test", args.math_prompts)]
            self._prompt_batches = lambda batch: [
                generation_inputs(tokenizer, self.math_prompts[start : start + batch])
                for start in range(0, len(self.math_prompts) - batch + 1, batch)
            ]
        return fresh_base, full_experts, {f"expert_{i}": source for i, source in enumerate(expert_sources)}

    def _letters_models(self, args):
        """The compare run's trained base, its joint experts (full and LoRA), and held-out joint strings."""
        config = load_config(Path(args.letters) / "config.yaml")
        components = prepare_components(config, Path(args.letters), progress=False)
        tokenizer, self.format = components.tokenizer, components.format
        self.config = AutoModelForCausalLM.from_pretrained(components.base_dir).config
        joint = list(config.task.joint)

        def fresh_base():
            model = components.load_base().to(self.device)
            model.generation_config.eos_token_id = None  # EOS is generated, but does not stop a run
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            return model

        def full_experts():
            return [components.load_expert(name).to(self.device) for name in joint]

        task = config.task.letter_task()
        member = task.membership("joint")
        strings = sample_strings(
            config.task.alphabet,
            args.letters_length,
            args.letters_strings,
            np.random.default_rng(0),
            keep=lambda text: is_held_out(text) and member(text),
        )
        self.letter_ids = encode_strings(tokenizer, strings)
        args.new_tokens = args.letters_length + 1  # the characters, then EOS
        self.parameters = fresh_base().num_parameters()
        self._decoding = {"max_new_tokens": args.new_tokens, "eos_token_id": [], "pad_token_id": tokenizer.pad_token_id}
        self._prompt_batches = self._letter_prompts
        return fresh_base, full_experts, {name: str(components.adapters[name]) for name in joint}

    # ------------------------------------------------------------------ prompts and runs

    def prompts(self, batch: int) -> list[dict]:
        """The prompt batches of one run: `generate` inputs (ids, mask and, for letters, positions) on the device."""
        return [{key: value.to(self.device) for key, value in prompt.items()} for prompt in self._prompt_batches(batch)]

    def _random_prompts(self, batch):
        generator = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, self.config.vocab_size, (batch, self.args.prompt_length), generator=generator)
        return [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]

    def _letter_prompts(self, batch):
        prompts = []
        for start in range(0, len(self.letter_ids) - batch + 1, batch):
            prompt = self.format.prompt(self.letter_ids[start : start + batch], self.new_tokens)
            prompts.append(
                {
                    "input_ids": prompt.input_ids,
                    "attention_mask": prompt.attention_mask,
                    "position_ids": prompt.position_ids,
                    "generated_position_ids": prompt.generated_position_ids,
                }
            )
        return prompts

    def _speculate(self, name, composed, prompt):
        out = composed.generate(
            **prompt,
            **self._decoding,
            draft="merged",
            num_draft_tokens=self.args.draft_tokens,
            draft_lambda=self.args.draft_lambda,
            adaptive_draft=not self.args.fixed_draft,
        )
        self.speculation[name].append(composed.speculation_stats)
        return out

    @torch.no_grad()
    def _run_base(self, prompt, model=None):
        # transformers continues `position_ids` by one per token: the letters' generated positions.
        prompt = {key: value for key, value in prompt.items() if key != "generated_position_ids"}
        return (self.base if model is None else model).generate(
            **prompt, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, do_sample=False
        )

    @torch.no_grad()
    def _run_naive(self, prompt):
        ids, mask = prompt["input_ids"], prompt["attention_mask"]
        for _ in range(self.new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = [
                m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1] for m in self.naive_models
            ]
            next_tokens = compose_logprobs(logits[0], logits[1:]).argmax(-1)
            ids = torch.cat([ids, next_tokens[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return ids


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_systems(bench: Workbench, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds per run of each system (every prompt batch once), interleaved, after one warm-up each."""
    prompts = bench.prompts(batch)

    def run(name):
        for prompt in prompts:
            out = bench.systems[name](prompt)
            made = out.shape[1] - prompt["input_ids"].shape[1]
            if made != bench.new_tokens:
                raise RuntimeError(f"{name} made {made} tokens, not {bench.new_tokens}")

    for name in bench.systems:
        run(name)
    for stats in bench.speculation.values():
        stats.clear()  # the warm-up's are not counted
    seconds = {name: [] for name in bench.systems}
    for _ in range(repeats):
        for name in bench.systems:
            _sync(bench.device)
            start = time.perf_counter()
            run(name)
            _sync(bench.device)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def speculation_summary(runs: list[SpeculationStats], draft_tokens: int) -> dict:
    """The acceptance statistics summed over `runs`, and the speed-up 3·E/(K+3) they predict for 2 full experts."""
    total = SpeculationStats(draft_tokens)
    for stats in runs:
        fields = ["rounds", "row_rounds", "draft_passes", "drafted", "tested", "accepted", "emitted", "plain_rounds"]
        for field in fields:
            setattr(total, field, getattr(total, field) + getattr(stats, field))
    a = total.acceptance_rate
    expected = (draft_tokens + 1) if a == 1 else (1 - a ** (draft_tokens + 1)) / (1 - a)
    return {**total.as_dict(), "predicted_speedup": 3 * expected / (draft_tokens + 3)}


def peak_rss_mb(args, system: str) -> float:
    """Peak RSS (MiB; on CUDA, peak device memory) of a fresh process that builds only `system` and decodes batch 1
    once."""
    command = [sys.executable, "-m", "benchmarks.decode", "--memory-child", system]
    for key in [
        "hidden",
        "layers",
        "heads",
        "intermediate",
        "vocab",
        "rank",
        "expert_scale",
        "prompt_length",
        "new_tokens",
        "draft_tokens",
        "letters_strings",
        "letters_length",
        "prompts",
        "math_prompts",
    ]:
        command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    command += [
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--arch",
        args.arch,
        "--lora-implementation",
        args.lora_implementation,
    ]
    if args.letters:
        command += ["--letters", args.letters]
    if args.model:
        command += ["--model", args.model, *(["--expert", *args.expert] if args.expert else [])]
    if args.draft_lambda:
        command += ["--draft-lambda", *map(str, args.draft_lambda)]
    if args.fixed_draft:
        command.append("--fixed-draft")
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return float(output.strip().splitlines()[-1])


def memory_child(args) -> None:
    bench = Workbench(args, [args.memory_child])
    bench.systems[args.memory_child](bench.prompts(1)[0])
    if bench.device.type == "cuda":
        print(torch.cuda.max_memory_allocated() / 2**20)  # peak device memory, MiB
    else:
        print(peak_rss_mib())  # peak RSS, MiB


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.letters and "naive" in args.systems:
        parser.error("--letters: the naive system re-runs with default positions; leave `naive` out of --systems")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args)
        return 0
    if args.smoke:
        apply_smoke(args)
    if args.prompts != "random" and not args.model:
        parser.error(f"--prompts: {args.prompts!r} needs a real base's tokenizer (--model); without it, 'random'")
    if args.prompts == "math" and args.math_prompts < max(args.batch_sizes):
        parser.error(
            f"--math-prompts: must be at least the largest batch size {max(args.batch_sizes)}, got {args.math_prompts}"
        )
    bench = Workbench(args, args.systems)
    started = conditions(args.repeats)
    parameters = bench.parameters
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "device": args.device,
        "dtype": args.dtype,
        "parameters": parameters,
        "args": vars(args),
        "batches": {},
    }
    models = f"letters models of {args.letters}" if args.letters else f"{parameters / 1e6:.1f} M parameters"
    if args.model:
        models = f"{args.model} ({models}), experts {args.expert or 'trained by benchmarks/real_model.py'}"
    print(
        f"decode benchmark: {models}, {args.dtype} on {args.device}, "
        f"prompt {_prompt_words(args)}, "
        f"{bench.new_tokens} new tokens, median of {args.repeats}"
    )
    for batch in args.batch_sizes:
        medians = time_systems(bench, batch, args.repeats)
        rows = {}
        for name, seconds in medians.items():
            tokens = batch * bench.new_tokens * len(bench.prompts(batch))
            rows[name] = {"seconds": seconds, "tokens_per_second": tokens / seconds}
        for name, row in rows.items():
            if "base" in rows:
                row["ratio_to_base"] = row["tokens_per_second"] / rows["base"]["tokens_per_second"]
            if "kernels" in rows:
                row["ratio_to_same_kernels"] = row["tokens_per_second"] / rows["kernels"]["tokens_per_second"]
            if name in SPECULATIVE:
                row.update(speculation_summary(bench.speculation[name], args.draft_tokens))
                bench.speculation[name].clear()
                if SPECULATIVE[name] in rows:
                    row["ratio_to_composition"] = (
                        row["tokens_per_second"] / rows[SPECULATIVE[name]]["tokens_per_second"]
                    )
        results["batches"][str(batch)] = rows
    results["speed_choices"] = speed_choices(bench)
    if not args.no_memory:
        peaks: dict[str, list[float]] = {name: [] for name in args.systems}
        for _ in range(args.memory_repeats):
            for name in args.systems:
                peaks[name].append(peak_rss_mb(args, name))
        results["peak_rss_mb"] = {name: statistics.median(values) for name, values in peaks.items()}
        results["peak_rss_mb_runs"] = peaks
    if args.profile:
        results["profile"] = profile_systems(bench, args.batch_sizes[0], args.profile)
    results["conditions"] = {"start": started, "end": conditions(args.repeats)}
    print_table(results)
    print(conditions_line(started, results["conditions"]["end"]))
    write_results(results, args.out)
    return 0


def speed_choices(bench: Workbench) -> dict[str, object]:
    """What the timings on this machine chose, by system: the compositions' `speed_choices`, and whether the
    same-kernels base is packed."""
    choices: dict[str, object] = {}
    for name in ["full", "lora"]:
        if hasattr(bench, name):
            choices[name] = getattr(bench, name).speed_choices
    if hasattr(bench, "kernel_linears"):
        linears = bench.kernel_linears
        choices["kernels"] = {
            "packed": linears.packed,
            **({"packing": linears.packing.summary()} if linears.packing else {}),
        }
    return choices


def profile_systems(bench: Workbench, batch: int, rows: int) -> dict[str, list[dict]]:
    """Each system's `rows` most expensive operators (self CPU time) in one run at `batch`, printed and returned."""
    prompts = bench.prompts(batch)

    def run(system):
        for prompt in prompts:
            system(prompt)

    return {
        name: profile_table(lambda system=system: run(system), f"{NAMES[name]}, batch {batch}", rows)
        for name, system in bench.systems.items()
    }


def _prompt_words(args) -> str:
    if args.letters:
        return "a letter string"
    if args.model and args.prompts == "math":
        return f"the first {args.math_prompts} math test problems (chat)"
    return f"{args.prompt_length} random ids"


def _ratio(row, key) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def print_table(results) -> None:
    rows = [
        [
            NAMES[name],
            batch,
            f"{row['tokens_per_second']:.1f}",
            _ratio(row, "ratio_to_base"),
            _ratio(row, "ratio_to_same_kernels"),
            _ratio(row, "ratio_to_composition"),
            _ratio(row, "acceptance_rate"),
            _ratio(row, "tokens_per_round"),
            _ratio(row, "predicted_speedup"),
        ]
        for batch, batch_rows in results["batches"].items()
        for name, row in batch_rows.items()
    ]
    print(
        markdown_table(
            [
                "system",
                "batch",
                "tokens/s",
                "ratio to (a)",
                "ratio to (a')",
                "ratio to its composition",
                "acceptance a",
                "tokens a round",
                "3E/(K+3)",
            ],
            rows,
            pad=True,
        )
    )
    if "peak_rss_mb" in results:
        memory = results["peak_rss_mb"]
        rows = [
            [NAMES[name], f"{value:.1f}", f"{value / memory['base']:.3f}" if "base" in memory else "-"]
            for name, value in memory.items()
        ]
        print(markdown_table(["system", "peak RSS MiB", "ratio to (a)"], rows, pad=True))
    for name, choices in results.get("speed_choices", {}).items():
        print(f"speed choices of {NAMES[name]}: {choices}")


if __name__ == "__main__":
    sys.exit(main())
