"""`mergecompose generate`: text from a base and its experts composed in probability space, streamed as it comes.

    mergecompose generate --base BASE --expert MATH --expert CODE [--weights 1 0.5] [--remedy "gate: 0.1"] "prompt"
    mergecompose generate --base BASE --expert MATH --prompts prompts.jsonl --out answers.jsonl

Everything is checked before a weight loads: the prompts, the remedy, the decoding options, the experts against the
base (`check_pretrained_sources`: names, weights, vocabularies, adapters' shapes and recorded bases) and `--out`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase, TextStreamer

from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.loading import PretrainedSources, check_pretrained_sources
from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import RemedySettings
from mergecompose.core.boundary import read_text_file
from mergecompose.core.cli_common import add_common_flags, add_composition_arguments, declare_paths, positive_int
from mergecompose.core.io import atomic_write_text, jsonl_values, validation_message
from mergecompose.core.precision import DTYPES

NO_CHAT_TEMPLATE = "the tokenizer of `--base` has no chat template: each prompt is given to the model as it is"


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = subparsers.add_parser(
        "generate",
        help="generate text with a base and its experts (full checkpoints or LoRA adapters) composed at every step",
        description="Compose a base and its experts in probability space, log p = log p_b + sum_i w_i (log p_i - "
        "log p_b), and generate from one prompt or a file of prompts; the text streams to the terminal.",
    )
    command.add_argument(
        "prompt",
        nargs="?",
        help="the prompt (or give --prompts); put it before --weights and --names, which take several values, or "
        "after `--`",
    )
    command.add_argument(
        "--prompts",
        metavar="FILE",
        help="a prompts file: one prompt per line, or, for a .jsonl file, one JSON object per line with a `prompt`",
    )
    add_composition_arguments(command, "the base model: a folder or a hub id")
    command.add_argument(
        "--remedy",
        metavar="YAML",
        help="remedies as a config's `remedies:` entry writes them, e.g. 'gate: 0.1' or "
        "'{termination: base, plausibility_alpha: 0.1}'",
    )
    command.add_argument(
        "--no-chat-template",
        action="store_true",
        help="give the prompts as they are, even where the tokenizer has a chat template",
    )
    command.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the models' dtype")
    decoding = command.add_argument_group("decoding (the options of ComposedLM.generate)")
    decoding.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="(default 128)")
    decoding.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    decoding.add_argument("--temperature", type=float, default=1.0)
    decoding.add_argument("--top-k", type=int, default=None)
    decoding.add_argument("--top-p", type=float, default=None)
    decoding.add_argument("--seed", type=int, default=None, help="seeds the sampling")
    decoding.add_argument(
        "--stop", action="append", dest="stop_strings", metavar="TEXT", help="a stop string (repeat for each)"
    )
    command.add_argument(
        "--out", metavar="FILE", help="also write JSONL: one line per prompt with its text and the settings"
    )
    command.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_common_flags(command, check=True)
    declare_paths(
        command,
        inputs=("base", "experts", "prompts"),
        outputs=(),
        output_files=("out",),
        not_paths=("names", "prompt", "remedy"),
    )
    command.set_defaults(func=run_generate, preflight=preflight_generate)


@dataclass(frozen=True)
class GenerateRun:
    """What the pre-flight checked: the prompts, the decoding options, the remedies and the sources."""

    prompts: list[str]
    decoding: DecodingConfig
    remedy: RemedySettings | None
    sources: PretrainedSources
    chat_template: bool


def preflight_generate(args: argparse.Namespace) -> GenerateRun:
    """Check everything before a weight loads (`mergecompose generate --check` stops here)."""
    prompts = read_prompts(args.prompt, args.prompts)
    remedy = parse_remedy(args.remedy)
    decoding = DecodingConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=args.stop_strings,
    )
    check_out_file(args.out, args.overwrite)
    sources = check_pretrained_sources(
        args.base, args.experts, args.weights, args.names, "stacked", {"dtype": DTYPES[args.dtype]}
    )
    if sources.tokenizer is None:
        raise ValueError(f"`--base` {args.base!r} has no tokenizer: generate needs one to read the prompts")
    if remedy is not None:
        _eos_id(sources.tokenizer)
    chat_template = not args.no_chat_template and bool(getattr(sources.tokenizer, "chat_template", None))
    if not args.no_chat_template and not chat_template:
        warnings.warn(NO_CHAT_TEMPLATE, UserWarning, stacklevel=2)
    return GenerateRun(prompts, decoding, remedy, sources, chat_template)


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """The one prompt, or the prompts of `prompts_file` (one per line; a .jsonl file: objects with `prompt`)."""
    if (prompt is None) == (prompts_file is None):
        raise ValueError(
            "give a prompt or `--prompts FILE`, not both" if prompt is not None else "give a prompt or `--prompts FILE`"
        )
    if prompt is not None:
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        return [prompt]
    assert prompts_file is not None
    text = read_text_file(prompts_file, "--prompts")
    if Path(prompts_file).suffix.lower() != ".jsonl":
        prompts = [line for line in text.splitlines() if line.strip()]
    else:
        prompts = []
        for number, record in jsonl_values(text, "--prompts", prompts_file):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise ValueError(
                    f"`--prompts` {prompts_file!r} line {number} must be an object with a non-empty string "
                    f"`prompt`, got {json.dumps(record)[:80]!r}"
                )
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"`--prompts` {prompts_file!r} holds no prompt")
    return prompts


def parse_remedy(text: str | None) -> RemedySettings | None:
    """`--remedy` as YAML: a mapping of `RemedySettings` fields, as a config's `remedies:` entry is written."""
    if text is None:
        return None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"`--remedy` {text!r} is not YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ValueError(
            f"`--remedy` must be a mapping of remedy fields ({sorted(RemedySettings.model_fields)}), "
            f"e.g. 'gate: 0.1'; got {text!r}"
        )
    try:
        return RemedySettings.model_validate(values)
    except ValidationError as error:
        raise ValueError(f"`--remedy` {text!r}: {validation_message(error)}") from None


def check_out_file(out: str | None, overwrite: bool) -> None:
    """An existing `--out` file is replaced only with `--overwrite` (where it may be written: the command line's
    `check_declared_paths`)."""
    if out is not None and Path(out).expanduser().exists() and not overwrite:
        raise FileExistsError(f"`--out` {out!r} exists; pass --overwrite to replace it")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat_template: bool) -> torch.Tensor:
    """The prompt's token ids (1, T): through the chat template as one user turn, or as it is."""
    if chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def run_generate(args: argparse.Namespace) -> int:
    run: GenerateRun = args.prepared
    tokenizer = run.sources.tokenizer
    assert tokenizer is not None  # the pre-flight refused a base without one
    remedies = [] if run.remedy is None else run.remedy.build(_eos_id(tokenizer))  # the pre-flight checked the id
    composed = ComposedLM.from_checked_sources(run.sources, args.experts, args.weights, remedies)
    settings = _settings(args, run)
    records = []
    with composed:
        for index, prompt in enumerate(run.prompts):
            if len(run.prompts) > 1 and not args.quiet:
                print(f"--- prompt {index + 1} of {len(run.prompts)}", flush=True)
            ids = prompt_ids(tokenizer, prompt, run.chat_template)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            output = composed.generate(ids, config=run.decoding, tokenizer=tokenizer, streamer=streamer)
            text = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
            records.append({"prompt": prompt, "text": text, "settings": settings})
    if args.out is not None:
        atomic_write_text(args.out, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        if not args.quiet:
            print(f"wrote {args.out}: {len(records)} line(s)")
    return 0


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("`--remedy` needs the EOS id of the tokenizer of `--base`, which has none")
    return int(tokenizer.eos_token_id)


def _settings(args: argparse.Namespace, run: GenerateRun) -> dict[str, Any]:
    decoding = {key: value for key, value in asdict(run.decoding).items() if key in _DECODING_KEYS}
    return {
        "base": args.base,
        "experts": dict(zip(run.sources.names, args.experts)),
        "weights": args.weights or [1.0] * len(args.experts),
        "remedy": None if run.remedy is None else run.remedy.model_dump(exclude_defaults=True),
        "chat_template": run.chat_template,
        "dtype": args.dtype,
        **decoding,
    }


_DECODING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop_strings")
