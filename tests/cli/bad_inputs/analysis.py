"""Bad input to the overlap analysis: data files, batches, masks, settings, and `mergecompose overlap` / `demo`."""

from __future__ import annotations

import json
import math

import torch

from bad_inputs import Api, Case, Cli
from mergecompose.analysis import OverlapAccumulator, measure_overlap, rollout_batches
from mergecompose.analysis.data import Record, char_tokenizer, encode_records, read_jsonl
from mergecompose.analysis.overlap_report import json_text
from mergecompose.composition import ComposedLM

CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ >"


def _data(env, lines, name: str = "data.jsonl"):
    path = env.tmp / name
    path.write_bytes(lines if isinstance(lines, bytes) else "".join(json.dumps(line) + "\n" for line in lines).encode())
    return path


def _composed(env) -> ComposedLM:
    return ComposedLM(env.base_model, [env.base_model, env.base_model])


def _batch(**overrides) -> dict:
    batch = {"input_ids": torch.tensor([[4, 5, 6, 7]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    return batch | overrides


def _measure(*batches):
    return lambda env: Api(lambda: measure_overlap(_composed(env), list(batches), progress=False))


def accumulator_without_positions(env):
    def call():
        accumulator = OverlapAccumulator(["a", "b"], 8)
        accumulator.update(torch.log_softmax(torch.randn(3, 1, 4, 8), -1), torch.zeros(1, 4, dtype=torch.bool))
        return accumulator.report()

    return Api(call)


def rollouts_without_input_ids(env):
    return Api(lambda: rollout_batches(_composed(env), [{"attention_mask": torch.ones(1, 3)}], max_new_tokens=2))


def _encode(texts, **kwargs):
    return lambda env: Api(
        lambda: encode_records([Record("", text) for text in texts], char_tokenizer(CHARACTERS), **kwargs)
    )


def _warns(texts, **kwargs):
    return lambda env: Api(
        lambda: encode_records([Record("", text) for text in texts], char_tokenizer(CHARACTERS), **kwargs),
        warns=UserWarning,
    )


def _read(lines):
    def build(env):
        path = _data(env, lines)
        return Api(lambda: read_jsonl(path), inputs=[path])

    return build


def _overlap(*extra, records=({"text": "ABCD ABCD XYZ"}, {"prompt": "CAB >", "completion": "BBA"})):
    """`mergecompose overlap` on the shared checkpoints with a char tokenizer; `records` a list or raw bytes."""

    def build(env):
        char_tokenizer(CHARACTERS).save_pretrained(env.tmp / "tokenizer")
        data = _data(env, records if isinstance(records, bytes) else list(records))
        argv = [
            "overlap",
            "--base",
            str(env.checkpoints / "base"),
            "--expert",
            str(env.checkpoints / "expert_0"),
            "--expert",
            str(env.checkpoints / "expert_1"),
            "--tokenizer",
            str(env.tmp / "tokenizer"),
            "--data",
            str(data),
            "--out",
            str(env.tmp / "out"),
            "--no-parameter-measures",
            "--quiet",
            *extra,
        ]
        return Cli(argv, inputs=[data, env.tmp / "tokenizer"])

    return build


def _rule(env, text: str):
    path = env.tmp / "rule.json"
    path.write_text(text)
    return path


def _overlap_with_parameters(*extra):
    """`_overlap` with the parameter-space measures (which `--recommend` needs)."""

    def build(env):
        cli = _overlap(*extra)(env)
        cli.argv.remove("--no-parameter-measures")
        return cli

    return build


CASES = [
    # measuring: batches and masks
    Case(
        "measure-mask-all-zero",
        "silent",
        _measure(_batch(measure_mask=torch.zeros(1, 4, dtype=torch.bool))),
        r"nothing was measured: `measure_mask`.*no position in the 1 batches \(1 rows\)",
    ),
    Case(
        "accumulator-report-without-positions",
        "silent",
        accumulator_without_positions,
        r"nothing to report.*0 positions",
    ),
    Case(
        "accumulator-weights-nan",
        "silent",
        lambda env: Api(lambda: OverlapAccumulator(["a", "b"], 8, weights=[math.nan, 1.0])),
        r"`weights\[0\]` must be a finite number, got nan",
    ),
    Case(
        "measure-batch-without-input-ids",
        "traceback",
        _measure({"ids": torch.tensor([[4, 5]])}),
        r"batch 0 has no `input_ids` \(its keys: \['ids'\]\)",
    ),
    Case("measure-batch-not-a-mapping", "traceback", _measure([[4, 5, 6]]), r"batch 0 must be a mapping.*got list"),
    Case(
        "measure-mask-wrong-shape",
        "traceback",
        _measure(_batch(measure_mask=torch.ones(1, 3, dtype=torch.bool))),
        r"batch 0: `measure_mask` must have the shape of `input_ids` \(1, 4\), got \(1, 3\)",
    ),
    Case(
        "measure-token-id-beyond-vocab",
        "traceback",
        _measure(_batch(input_ids=torch.tensor([[4, 5, 6, 70]]))),
        r"`input_ids` must be token ids in \[0, 64\).*got 70",
    ),
    Case("rollouts-batch-without-input-ids", "traceback", rollouts_without_input_ids, r"batch 0 has no `input_ids`"),
    Case(
        "json-nan-written-as-null",
        "silent",
        lambda env: Api(lambda: json_text({"a": {"b": math.nan}}, "x.json"), warns=UserWarning),
        r"x\.json: 1 values were NaN.*written as null: a\.b",
    ),
    # data files and records
    Case(
        "data-not-utf8",
        "traceback",
        _read('{"text": "AB"}\n{"text": "caf\xe9"}\n'.encode("latin-1")),
        r"data\.jsonl:2 is not UTF-8 text: byte b'\\xe9'",
    ),
    Case(
        "records-longer-than-max-length",
        "silent",
        _encode(["ABCDEFGH", "AB"], max_length=4),
        r"1 of 2 records are longer than 4 tokens \(`max_length`\).*record 0\) has 8; pass truncate=True",
    ),
    Case(
        "records-truncated-when-asked",
        "silent",
        _warns(["ABCDEFGH", "AB"], max_length=4, truncate=True),
        r"1 of 2 records are longer than 4 tokens.*cut them to 4 tokens, dropping 4 tokens",
    ),
    Case(
        "records-of-unknown-characters",
        "silent",
        _warns(["ΩΩΩ ΨΨ", "AB"], max_length=16),
        r"62% of the tokens \(5 of 8\) are the unknown token '<unk>'",
    ),
    # mergecompose overlap: every flag's domain, before any model loads
    Case("overlap-lam-nan", "traceback", _overlap("--lam", "nan"), r"lam"),
    Case("overlap-lam-inf", "silent", _overlap("--lam", "inf"), r"lam.*finite"),
    Case(
        "overlap-batch-size-zero", "traceback", _overlap("--batch-size", "0"), r"batch_size.*greater than or equal to 1"
    ),
    Case(
        "overlap-max-length-zero", "traceback", _overlap("--max-length", "0"), r"max_length.*greater than or equal to 2"
    ),
    Case(
        "overlap-epsilon-negative", "traceback", _overlap("--epsilon", "-0.1"), r"epsilon.*greater than or equal to 0"
    ),
    Case("overlap-epsilon-inf", "silent", _overlap("--epsilon", "inf"), r"epsilon.*finite"),
    Case("overlap-density-zero", "traceback", _overlap("--density", "0"), r"parameter_density.*greater than 0"),
    Case(
        "overlap-max-new-tokens-negative",
        "traceback",
        _overlap("--rollouts", "composed", "--max-new-tokens", "-2"),
        r"max_new_tokens.*greater than or equal to 1",
    ),
    Case(
        "overlap-rollouts-unknown-expert",
        "traceback",
        _overlap("--rollouts", "expert:nobody"),
        r"`rollouts` entry 'expert:nobody' names no expert; the experts are \['expert_0', 'expert_1'\]",
    ),
    Case(
        "overlap-rollouts-beyond-context",
        "silent",
        _overlap("--rollouts", "composed", "--max-new-tokens", "300"),
        r"prompts of up to \d+ tokens plus `max_new_tokens` = 300 exceed the base's context of 256",
    ),
    Case(
        "overlap-records-beyond-context",
        "silent",
        _overlap("--max-length", "1000", records=[{"text": "AB" * 150}]),
        r"1 of 1 records are longer than 256 tokens \(the base's context, `max_position_embeddings`\).*--truncate",
    ),
    Case(
        "overlap-records-beyond-max-length",
        "silent",
        _overlap("--max-length", "8"),
        r"1 of 2 records are longer than 8 tokens \(`max_length`\), the longest \(record 0\) has 13",
    ),
    Case(
        "overlap-data-not-utf8",
        "traceback",
        _overlap(records='{"text": "caf\xe9"}\n'.encode("latin-1")),
        r"data\.jsonl:1 is not UTF-8 text",
    ),
    Case(
        "overlap-data-line-not-a-record",
        "traceback",
        _overlap(records=b'{"text": "AB"}\n{"question": "?"}\n'),
        r"data\.jsonl:2: a record must be",
    ),
    Case("overlap-data-empty", "traceback", _overlap(records=b"\n"), r"data.jsonl' holds no records"),
    # mergecompose overlap --recommend: its rule, before any model loads
    Case(
        "overlap-rule-without-recommend",
        "clear",
        lambda env: _overlap("--rule", str(_rule(env, "{}")))(env),
        r"`rule`.*--recommend",
    ),
    Case(
        "overlap-recommend-rule-missing",
        "clear",
        _overlap("--recommend", "--rule", "no/such/rule.json"),
        r"`rule` must be an existing.*no/such/rule.json",
    ),
    Case(
        "overlap-recommend-rule-not-a-rule",
        "clear",
        lambda env: _overlap_with_parameters("--recommend", "--rule", str(_rule(env, '{"compose": {}}')))(env),
        r"merge.*Field required",
    ),
    Case(
        "overlap-recommend-without-parameter-measures",
        "clear",
        _overlap("--recommend"),
        r"`recommend` reads the parameter-space measures",
    ),
    # mergecompose demo
    Case(
        "demo-max-new-tokens-beyond-context",
        "silent",
        lambda env: Cli(["demo", "--max-new-tokens", "300", "--quiet"]),
        r"`max_new_tokens`=300 needs \d+ positions, beyond the model's context of 256",
    ),
]
