"""Bad input to `mergecompose generate`: prompts, weights, remedies, experts of another base, `--out`."""

from __future__ import annotations

from bad_inputs import Case, Cli
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config


def _generate(*extra: str, prompt: str | None = "x"):
    """`mergecompose generate` on the tiny base and its two adapters, with `extra` arguments."""

    def build(env):
        argv = ["generate", *([] if prompt is None else [prompt]), "--base", str(env.checkpoints / "base")]
        for adapter in env.lora_dirs.values():
            argv += ["--expert", str(adapter)]
        return Cli([*argv, "--max-new-tokens", "2", *extra])

    return build


def _prompts_file(name: str, text: str):
    def build(env):
        path = env.tmp / name
        path.write_text(text)
        return _generate("--prompts", str(path), prompt=None)(env)

    return build


def _expert_of_another_base(env):
    """An adapter trained on a base twice as wide: its factors cannot fit the base given."""
    other = random_llama(tiny_llama_config(hidden_size=64), seed=3)
    adapter = random_lora_adapter(other, env.tmp / "wide", seed=4)
    return Cli(["generate", "--base", str(env.checkpoints / "base"), "--expert", str(adapter), "x"])


def _out_over_an_input(env):
    out = env.lora_dirs["ab"] / "adapter_config.json"
    return _generate("--out", str(out), "--overwrite")(env)


CASES = [
    Case(
        "generate-empty-prompts-file", "clear", _prompts_file("empty.txt", ""), r"`--prompts` '.*empty\.txt'.* is empty"
    ),
    Case(
        "generate-prompts-file-of-blank-lines",
        "clear",
        _prompts_file("blank.txt", "\n  \n"),
        r"`--prompts` '.*blank\.txt' holds no prompt",
    ),
    Case(
        "generate-prompts-not-jsonl",
        "clear",
        _prompts_file("bad.jsonl", '{"prompt": "a"}\nnot json\n'),
        r"`--prompts` '.*bad\.jsonl' line 2 is not JSON",
    ),
    Case(
        "generate-jsonl-without-a-prompt",
        "clear",
        _prompts_file("other.jsonl", '{"text": "a"}\n'),
        r"line 1 must be an object with a non-blank string `prompt`",
    ),
    Case("generate-no-prompt", "clear", _generate(prompt=None), r"give a prompt or `--prompts FILE`"),
    Case(
        "generate-weights-of-another-count",
        "clear",
        _generate("--weights", "1.0"),
        r"`weights` must hold one weight per expert \(2\), got 1",
    ),
    Case(
        "generate-expert-of-another-base",
        "clear",
        _expert_of_another_base,
        r"adapter `wide` was made for another base: its `.*lora_A\.weight` has shape \(4, 128\), but the base.s",
    ),
    Case(
        "generate-remedy-not-a-mapping",
        "clear",
        _generate("--remedy", "gate"),
        r"`--remedy` must be a mapping of remedy fields",
    ),
    Case("generate-remedy-out-of-range", "clear", _generate("--remedy", "{gate: -1}"), r"`--remedy` .*gate"),
    # A remedy of one's own (`tests/extensions/user_remedies.py`): refused before any model loads.
    Case(
        "generate-remedy-class-that-does-not-import",
        "clear",
        _generate("--remedy", "{class: no_such_package.remedies:Temper}"),
        r"`class` 'no_such_package.remedies:Temper': module 'no_such_package.remedies' does not import",
    ),
    Case(
        "generate-remedy-class-without-the-protocol",
        "clear",
        _generate("--remedy", "{class: collections:OrderedDict}"),
        r"'collections:OrderedDict' does not make a remedy: remedy OrderedDict declares no phase",
    ),
    Case(
        "generate-remedy-class-of-no-phase",
        "clear",
        _generate("--remedy", "{class: user_remedies:LogitsPhase}"),
        r"LogitsPhase declares phase 'logits', which is not one: .*one of exponent, score, mask, termination",
    ),
    Case(
        "generate-remedy-class-without-its-method",
        "clear",
        _generate("--remedy", "{class: user_remedies:NoMethod}"),
        r"NoMethod declares phase 'mask' but has no method `allowed`",
    ),
    Case(
        "generate-remedy-class-parameter-it-does-not-take",
        "clear",
        _generate("--remedy", "{class: user_remedies:BaseTopK, top: 3}"),
        r"'user_remedies:BaseTopK' takes no parameter 'top'; it takes \['k'\]",
    ),
    Case(
        "generate-remedy-class-parameter-it-refuses",
        "clear",
        _generate("--remedy", "{class: user_remedies:BaseTopK, k: 0}"),
        r"user_remedies:BaseTopK\(k=0\): ValueError: `k` must be an integer >= 1, got 0",
    ),
    Case("generate-out-over-an-input", "clear", _out_over_an_input, r"`--out` .* lies inside the input"),
    Case(
        "generate-out-is-a-folder",
        "clear",
        lambda env: _generate("--out", str(env.tmp))(env),
        r"is a folder; give a file",
    ),
    Case("generate-base-without-a-tokenizer", "clear", _generate(), r"`--base` .* has no tokenizer"),
]
