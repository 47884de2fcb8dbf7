"""Bad input to `mergecompose decide` (and `joint-task`), each refused in one line before any model loads."""

from __future__ import annotations

import json

from bad_inputs import Case, Cli
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config

GOOD_LINE = {"prompt": "What is 2 plus 2?", "reference": "4"}


def _decide(*extra: str, lines=None, task_text: str | None = None, experts=None):
    """`mergecompose decide` on the tiny base and its two adapters, with a task of `lines` (default 50 good ones)."""

    def build(env):
        task = env.tmp / "task.jsonl"
        if task_text is not None:
            task.write_text(task_text)
        else:
            task.write_text("".join(json.dumps(line) + "\n" for line in (lines or [GOOD_LINE] * 50)))
        argv = ["decide", "--base", str(env.checkpoints / "base"), "--task", str(task), "--scorer", "exact"]
        for adapter in experts(env) if experts else env.lora_dirs.values():
            argv += ["--expert", str(adapter)]
        return Cli([*argv, "--out", str(env.tmp / "out"), *extra], inputs=[task])

    return build


def _grid(text: str):
    def build(env):
        grid = env.tmp / "grid.yaml"
        grid.write_text(text)
        return _decide("--grid", str(grid))(env)

    return build


def _other_base(env):
    other = random_llama(tiny_llama_config(hidden_size=64), seed=3)
    return [env.lora_dirs["ab"], random_lora_adapter(other, env.tmp / "wide", seed=4)]


def _out_over_the_task(env):
    build = _decide()(env)
    argv = list(build.argv)
    argv[argv.index("--out") + 1] = str(env.tmp)
    return Cli(argv, inputs=build.inputs)


CASES = [
    Case(
        "decide-task-without-references",
        "clear",
        _decide(lines=[{"prompt": "a"}] * 50),
        r"`--task` '.*task\.jsonl' line 1 has no `reference`: decide needs a labelled task",
    ),
    Case(
        "decide-task-not-jsonl",
        "clear",
        _decide(task_text='{"prompt": "a", "reference": "b"}\nnot json\n'),
        r"`--task` '.*task\.jsonl' line 2 is not JSON",
    ),
    Case(
        "decide-task-blank-prompt",
        "clear",
        _decide(lines=[{"prompt": "   ", "reference": "b"}]),
        r"line 1 must be an object with a non-empty string `prompt`",
    ),
    Case(
        "decide-task-too-small-for-validation",
        "clear",
        _decide(lines=[GOOD_LINE] * 10),
        r"`--task` '.*' holds 10 items: at least 41 are needed",
    ),
    Case("decide-unknown-scorer", "clear", _decide("--scorer", "fuzzy"), r"`--scorer` 'fuzzy' is not a scorer"),
    Case(
        "decide-scorer-that-does-not-import",
        "clear",
        _decide("--scorer", "no_such_module_here:score"),
        r"`--scorer` 'no_such_module_here:score': module 'no_such_module_here' does not import",
    ),
    Case(
        "decide-scorer-not-a-function",
        "clear",
        _decide("--scorer", "json:no_such_function"),
        r"module 'json' has no function 'no_such_function'",
    ),
    Case(
        "decide-scorer-of-the-wrong-signature",
        "clear",
        _decide("--scorer", "json:dumps"),
        r"`--scorer` 'json:dumps' must take \(prompt, output, reference\)",
    ),
    Case(
        "decide-skills-reference-malformed",
        "clear",
        _decide("--scorer", "skills"),
        r"line 1: a `skills` reference must be an object with answer, skills, content, form",
    ),
    Case("decide-max-items-zero", "clear", _decide("--max-items", "0"), r"`--max-items` must be at least 1, got 0"),
    Case(
        "decide-alpha-out-of-range", "clear", _decide("--alpha", "0.7"), r"`--alpha` must be in \(0, 0\.5\), got 0\.7"
    ),
    Case("decide-alpha-nan", "clear", _decide("--alpha", "nan"), r"`--alpha` must be in \(0, 0\.5\), got nan"),
    Case("decide-delta-out-of-range", "clear", _decide("--delta", "1.5"), r"`--delta` must be in \(0, 1\), got 1\.5"),
    Case(
        "decide-one-expert",
        "clear",
        _decide(experts=lambda env: [env.lora_dirs["ab"]]),
        r"`--expert` must be given at least twice",
    ),
    Case(
        "decide-expert-of-another-base",
        "clear",
        _decide(experts=_other_base),
        r"adapter `wide` was made for another base",
    ),
    Case(
        "decide-base-without-a-tokenizer",
        "clear",
        _decide(),
        r"`--base` '.*base' has no tokenizer: decide needs one",
    ),
    Case("decide-out-over-the-task", "clear", _out_over_the_task, r"--out"),
    Case(
        "decide-grid-of-four-points",
        "clear",
        _grid("merges:\n  task_arithmetic: {lam: [0.25, 0.5, 1.0, 1.5]}\n"),
        r"`merges\.task_arithmetic` must have at most 3 grid points, got 4",
    ),
    Case(
        "decide-grid-unknown-method",
        "clear",
        _grid("merges:\n  average_everything: {lam: [1.0]}\n"),
        r"unknown merge methods \['average_everything'\]",
    ),
    Case(
        "decide-grid-unknown-key", "clear", _grid("merge: {}\n"), r"`--grid` '.*grid\.yaml' must be a mapping of merges"
    ),
    Case(
        "joint-task-unknown-skill",
        "clear",
        lambda env: Cli(["joint-task", "units", "poetry", "--out", str(env.tmp / "t.jsonl")]),
        r"poetry",
    ),
    Case(
        "joint-task-out-in-a-missing-folder",
        "clear",
        lambda env: Cli(["joint-task", "units", "json", "--out", str(env.tmp / "nowhere" / "t.jsonl")]),
        r"`--out` '.*t\.jsonl': its folder '.*nowhere' does not exist",
    ),
]
