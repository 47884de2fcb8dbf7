"""`mergecompose generate`: text from a base and its experts composed in probability space, streamed as it comes.

    mergecompose generate --base BASE --expert MATH --expert CODE [--weights 1 0.5] [--remedy "gate: 0.1"] "prompt"
    mergecompose generate --base BASE --expert MATH --prompts prompts.jsonl --out answers.jsonl

Everything is checked before a weight loads: the prompts, the remedy, the decoding options, the experts against the
base (`check_pretrained_sources`: names, weights, vocabularies, adapters' shapes and recorded bases) and `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import ValidationError
from transformers import AutoConfig, PreTrainedTokenizerBase, TextStreamer

from mergecompose.composition.architecture import config_context_length
from mergecompose.composition.decoding_config import DecodingConfig
from mergecompose.composition.loading import PretrainedSources, check_pretrained_sources
from mergecompose.composition.model import ComposedLM
from mergecompose.composition.remedies import RemedySettings
from mergecompose.composition.rule import MAX_ABS_WEIGHT
from mergecompose.composition.sampling import NAN_COMPOSITION
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
        help="a prompts file: one prompt per line (blank lines are skipped); a .jsonl file: one JSON object per line "
        "with a non-blank `prompt`; a .json file: a JSON list of such objects or of prompts",
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
        "--out",
        metavar="FILE",
        help="also write JSONL: a line per prompt (its text and the settings), appended as each prompt finishes; "
        "missing folders above it are created",
    )
    keep = command.add_mutually_exclusive_group()
    keep.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out file (once the first answer is finished)"
    )
    keep.add_argument(
        "--resume",
        action="store_true",
        help="go on from an existing --out: the prompts it answers (same prompts, same settings) are skipped",
    )
    add_common_flags(command, check=True)
    declare_paths(
        command,
        inputs=("base", "experts", "prompts"),
        outputs=(),
        output_files=("out",),
        not_paths=("names", "prompt", "remedy"),
    )
    command.set_defaults(func=run_generate, preflight=preflight_generate, interrupted=_interrupted)


def _interrupted(args: argparse.Namespace) -> str:
    if args.out is None:
        return "interrupted (Ctrl-C)"
    return (
        f"interrupted (Ctrl-C); every finished answer is in {args.out}: add --resume to the same command to go on "
        "from them"
    )


@dataclass(frozen=True)
class GenerateRun:
    """What the pre-flight checked: the prompts, the decoding options, the remedies and the sources."""

    prompts: list[str]
    decoding: DecodingConfig
    remedy: RemedySettings | None
    sources: PretrainedSources
    chat_template: bool
    prompt_ids: list[torch.Tensor]  # (1, T) each
    settings: dict[str, Any]  # what each line of --out records
    answers: AnswersFile | None  # --out


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
    check_out_file(args.out, args.overwrite, args.resume)
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
    ids = [prompt_ids(sources.tokenizer, prompt, chat_template) for prompt in prompts]
    check_context_fits(ids, args.max_new_tokens, sources.base)
    settings = _settings(args, sources.names, remedy, chat_template, decoding)
    answers = None if args.out is None else AnswersFile.open(args.out, prompts, settings, resume=args.resume)
    return GenerateRun(prompts, decoding, remedy, sources, chat_template, ids, settings, answers)


def check_context_fits(ids: list[torch.Tensor], max_new_tokens: int, base: str) -> None:
    """Refuse, before a weight loads, a prompt that with `--max-new-tokens` needs more positions than the base's
    context (its config's `max_position_embeddings`), at any size of `--max-new-tokens`."""
    context = config_context_length(AutoConfig.from_pretrained(base))
    if context is None:
        return
    if max_new_tokens >= context:
        raise ValueError(
            f"`--max-new-tokens` {max_new_tokens} is beyond the context of `--base` ({context} positions, its "
            "`max_position_embeddings`), which must hold the prompt too"
        )
    for index, prompt in enumerate(ids):
        if prompt.shape[1] + max_new_tokens > context:
            raise ValueError(
                f"prompt {index + 1} ({prompt.shape[1]} tokens) plus `--max-new-tokens` {max_new_tokens} needs "
                f"{prompt.shape[1] + max_new_tokens} positions, beyond the context of `--base` ({context} positions, "
                "its `max_position_embeddings`): shorten the prompt or lower --max-new-tokens"
            )


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
    suffix = Path(prompts_file).suffix.lower()
    if suffix == ".jsonl":
        records = jsonl_values(text, "--prompts", prompts_file)
        prompts = [_prompt(record, prompts_file, f"line {number}") for number, record in records]
    elif suffix == ".json":
        prompts = _json_prompts(text, prompts_file)
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"`--prompts` {prompts_file!r} holds no prompt")
    return prompts


def _json_prompts(text: str, prompts_file: str) -> list[str]:
    """The prompts of a .json file: a list of prompts, or of objects with a `prompt`."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and all(_is_json(line) for line in lines):
            raise ValueError(
                f"`--prompts` {prompts_file!r} holds one JSON value per line (JSON lines), not one JSON value: "
                "name it .jsonl"
            ) from None
        raise ValueError(f"`--prompts` {prompts_file!r} is not JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(
            f"`--prompts` {prompts_file!r} must hold a JSON list of prompts or of objects with a `prompt`, got "
            f"{_quoted(data)}"
        )
    return [_prompt(item, prompts_file, f"item {index}", strings=True) for index, item in enumerate(data)]


def _prompt(record: object, prompts_file: str, where: str, strings: bool = False) -> str:
    """The prompt of one record of a .jsonl or .json file: an object's `prompt` (or, `strings`, a string itself);
    never blank."""
    prompt = record.get("prompt") if isinstance(record, dict) else record if strings else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"`--prompts` {prompts_file!r} {where} must be an object with a non-blank string `prompt`"
            f"{' or a non-blank string' if strings else ''}, got {_quoted(record)}"
        )
    return prompt


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _quoted(value: object, limit: int = 80) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


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


def check_out_file(out: str | None, overwrite: bool, resume: bool = False) -> None:
    """An existing `--out` file is replaced only with `--overwrite`, or gone on from with `--resume` (where it may be
    written: the command line's `check_declared_paths`)."""
    if out is None:
        if resume:
            raise ValueError("`--resume` goes on from the answers in `--out`; give --out FILE")
        return
    if Path(out).expanduser().exists() and not (overwrite or resume):
        raise FileExistsError(
            f"`--out` {out!r} exists; pass --resume to go on from its answers, or --overwrite to replace it"
        )


class AnswersFile:
    """`--out`: one JSON line per prompt, `{"prompt", "text", "settings"}`, appended as each prompt finishes.

    Each line is written whole (one write, flushed and synced), so that an interrupted or killed run keeps every
    finished answer. The first line replaces an existing file atomically (`--overwrite`: the old answers stay until
    a new one is finished); with `--resume`, the lines already there must answer the first prompts with the same
    settings, and a last line cut by a kill is dropped."""

    def __init__(self, path: Path, answered: int, keep_bytes: int | None):
        self.path = path
        self.answered = answered  # prompts answered in the file already
        self._keep_bytes = keep_bytes  # --resume: the whole lines' length, where a cut line follows them
        self._replace = answered == 0  # the first line replaces whatever is there

    @classmethod
    def open(cls, out: str, prompts: list[str], settings: dict[str, Any], resume: bool) -> AnswersFile:
        """Check an existing file against the run (with `resume`); nothing is written here."""
        path = Path(out).expanduser()
        if not (resume and path.exists()):
            return cls(path, 0, None)
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        answered = 0
        for number, line in enumerate(whole.decode("utf-8", errors="replace").splitlines(), 1):
            record = _answer(line, out, number)
            if number > len(prompts) or record["prompt"] != prompts[number - 1]:
                raise ValueError(
                    f"`--out` {out!r} line {number} answers {_quoted(record['prompt'])}, not prompt {number} of this "
                    f"run{'' if number > len(prompts) else ' ' + _quoted(prompts[number - 1])}: --resume needs the "
                    "same prompts in the same order (or pass --overwrite)"
                )
            if record["settings"] != settings:
                key = next(
                    k for k in sorted({*record["settings"], *settings}) if record["settings"].get(k) != settings.get(k)
                )
                raise ValueError(
                    f"`--out` {out!r} line {number} was generated with {key}={_quoted(record['settings'].get(key))}, "
                    f"this run has {key}={_quoted(settings.get(key))}: --resume needs the same settings (or pass "
                    "--overwrite)"
                )
            answered = number
        if len(whole) < len(data):
            warnings.warn(
                f"`--out` {out!r}: its last line was cut (a killed run); it is dropped and that prompt generated again",
                UserWarning,
                stacklevel=2,
            )
        return cls(path, answered, len(whole) if len(whole) < len(data) else None)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self._replace:
            atomic_write_text(self.path, line)
            self._replace = False
            return
        with open(self.path, "r+b") as file:
            if self._keep_bytes is not None:
                file.truncate(self._keep_bytes)
                self._keep_bytes = None
            file.seek(0, os.SEEK_END)
            file.write(line.encode("utf-8"))
            file.flush()
            os.fsync(file.fileno())


def _answer(line: str, out: str, number: int) -> dict[str, Any]:
    """One whole line of an existing `--out`, checked to be what `generate` writes."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    if not (
        isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("settings"), dict)
    ):
        raise ValueError(
            f"`--out` {out!r} line {number} is not an answer `generate` wrote (a JSON object with `prompt`, `text` "
            f"and `settings`), got {_quoted(line)}: --resume goes on from a file generate wrote (or pass --overwrite)"
        )
    return record


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
    done = 0 if run.answers is None else run.answers.answered
    if done == len(run.prompts):
        if not args.quiet:
            print(f"{args.out} answers every prompt ({done}) already: nothing to generate")
        return 0
    if done and not args.quiet:
        print(f"resuming: {done} of {len(run.prompts)} prompts are answered in {args.out}", flush=True)
    remedies = [] if run.remedy is None else run.remedy.build(_eos_id(tokenizer))  # the pre-flight checked the id
    composed = ComposedLM.from_checked_sources(run.sources, args.experts, args.weights, remedies)
    with composed:
        for index in range(done, len(run.prompts)):
            if len(run.prompts) > 1 and not args.quiet:
                print(f"--- prompt {index + 1} of {len(run.prompts)}", flush=True)
            ids = run.prompt_ids[index]
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            output = _generate(composed, ids, run, streamer)
            text = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
            if run.answers is not None:
                run.answers.append({"prompt": run.prompts[index], "text": text, "settings": run.settings})
    if args.out is not None and not args.quiet:
        print(f"wrote {args.out}: {len(run.prompts)} line(s)")
    return 0


def _generate(composed: ComposedLM, ids: torch.Tensor, run: GenerateRun, streamer: TextStreamer) -> torch.Tensor:
    """One prompt's output; a NaN step names the weights, which the user may have set too far."""
    try:
        return composed.generate(ids, config=run.decoding, tokenizer=run.sources.tokenizer, streamer=streamer)
    except ValueError as error:
        if str(error) != NAN_COMPOSITION:
            raise
        raise ValueError(
            f"{NAN_COMPOSITION}; `--weights` were {run.settings['weights']} (allowed: |w| <= {MAX_ABS_WEIGHT:g}; "
            "smaller weights, or --dtype float32, keep the sums finite)"
        ) from None


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("`--remedy` needs the EOS id of the tokenizer of `--base`, which has none")
    return int(tokenizer.eos_token_id)


def _settings(
    args: argparse.Namespace,
    names: list[str],
    remedy: RemedySettings | None,
    chat_template: bool,
    decoding_config: DecodingConfig,
) -> dict[str, Any]:
    decoding = {key: value for key, value in asdict(decoding_config).items() if key in _DECODING_KEYS}
    settings = {
        "base": args.base,
        "experts": dict(zip(names, args.experts)),
        "weights": args.weights or [1.0] * len(args.experts),
        "remedy": None if remedy is None else remedy.model_dump(exclude_defaults=True),
        "chat_template": chat_template,
        "dtype": args.dtype,
        **decoding,
    }
    return json.loads(json.dumps(settings))  # as a line of --out reads back (lists, not tuples), for --resume


_DECODING_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop_strings")
