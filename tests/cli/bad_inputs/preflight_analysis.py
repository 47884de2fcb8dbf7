"""Bad input found by the pre-flights of `mergecompose overlap` (`--recommend`, `--rule`), `predict-sweep` and
`overlap-sweep`: before any model loads or any training starts."""

from __future__ import annotations

import json

import torch
import yaml

from bad_inputs import Api, Case, Cli
from mergecompose.analysis.overlap_run import OverlapRunConfig, preflight_overlap
from mergecompose.studies.letters.overlap_sweep import SweepConfig, preflight_overlap_sweep
from mergecompose.studies.predict import PredictConfig, preflight_predict

# A rule that reads two measured diagnostics; each row spoils one part.
RULE = {
    "compose": {"feature": "active_fraction_sum", "threshold": 0.3, "direction": "below"},
    "merge": {"feature": "expert_kl_mean", "threshold": 1.0, "direction": "below"},
    "remedy": {"feature": "projective_error", "threshold": 0.005, "direction": "below"},
}
# The smallest compare config a predict family or a sweep validates (nothing is trained in these rows).
COMPARE = {
    "task": {"train_lengths": [1, 6]},
    "positions": {"max_position": 48},
    "evaluation": {"lengths": [6]},
    "model": {"hidden_size": 32, "max_position_embeddings": 48},
    "training": {"base": {"steps": 5}, "experts": {"full": {"steps": 5}}},
}
SKILLS = {"ab": {"A": "B"}, "cd": {"C": "D"}}


def _overlap(*extra, rule: bytes | dict | None = None):
    """`mergecompose overlap --recommend` on the shared checkpoints, with `rule` written to rule.json."""

    def build(env):
        data = env.tmp / "data.jsonl"
        data.write_text('{"text": "ABCD"}\n')
        argv = ["overlap", "--base", str(env.checkpoints / "base"), "--expert", str(env.checkpoints / "expert_0")]
        argv += ["--data", str(data), "--out", str(env.tmp / "out"), "--recommend", "--quiet", *extra]
        inputs = [data]
        if rule is not None:
            path = env.tmp / "rule.json"
            path.write_bytes(rule if isinstance(rule, bytes) else json.dumps(rule).encode())
            argv += ["--rule", str(path)]
            inputs.append(path)
        return Cli(argv, inputs=inputs)

    return build


def _rule_with(part: str, **threshold) -> dict:
    return {**RULE, part: threshold}


def _preflight_overlap(**overrides):
    """`preflight_overlap` called directly (what `mergecompose overlap --check` runs)."""

    def build(env):
        data = env.tmp / "data.jsonl"
        data.write_text('{"text": "ABCD"}\n')
        values = {
            "base": str(env.checkpoints / "base"),
            "experts": [str(env.checkpoints / "expert_0"), str(env.checkpoints / "expert_1")],
            "data": str(data),
            "out": str(env.tmp / "out"),
        }
        config = OverlapRunConfig.model_validate(values | overrides)
        return Api(lambda: preflight_overlap(config), inputs=[data])

    return build


def _compare_file(env, folder: str, compare: dict) -> None:
    (env.tmp / folder).mkdir(exist_ok=True)
    (env.tmp / folder / "compare.yaml").write_text(yaml.safe_dump(compare))


def _predict(compare: dict | None, name: str = "compare.yaml"):
    """`preflight_predict` on a one-family config in tmp/cfg/, whose `compare` is relative to that folder."""

    def build(env):
        if compare is not None:
            _compare_file(env, "cfg", compare)
        family = {"compare": name, "letter_skills": SKILLS, "settings": [{"name": "ab_cd", "pair": ["ab", "cd"]}]}
        path = env.tmp / "cfg" / "predict.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.safe_dump({"families": {"letters": family}}))
        config = PredictConfig.model_validate(yaml.safe_load(path.read_text()))
        return Api(lambda: preflight_predict(config, path), inputs=[path.parent])

    return build


def _predict_cli_without_training(env):
    _compare_file(env, "cfg", {key: value for key, value in COMPARE.items() if key != "training"})
    family = {
        "compare": str(env.tmp / "cfg" / "compare.yaml"),
        "letter_skills": SKILLS,
        "settings": [{"name": "ab_cd", "pair": ["ab", "cd"]}],
    }
    path = env.tmp / "predict.yaml"
    path.write_text(yaml.safe_dump({"families": {"letters": family}}))
    return Cli(["predict-sweep", str(path), "--out", str(env.tmp / "out")], inputs=[path, env.tmp / "cfg"])


def _sweep(compare: dict):
    def build(env):
        _compare_file(env, "cfg", compare)
        path = env.tmp / "cfg" / "sweep.yaml"
        path.write_text(yaml.safe_dump({"compare": "compare.yaml", "skills": SKILLS, "pairs": [["ab", "cd"]]}))
        config = SweepConfig.model_validate(yaml.safe_load(path.read_text()))
        return Api(lambda: preflight_overlap_sweep(config, path), inputs=[path.parent])

    return build


CASES = [
    # mergecompose overlap --recommend --rule: the rule file and the diagnostics it reads, before any model loads
    Case(
        "preflight-overlap-rule-not-json",
        "misleading",
        _overlap(rule=b"compose: yes\n"),
        r"`rule` file '.*rule\.json' is not JSON \(Expecting value at line 1 column 1\); expected a predict_rule\.json",
    ),
    Case(
        "preflight-overlap-rule-not-utf8",
        "traceback",
        _overlap(rule='{"compose": "\xe9"}'.encode("latin-1")),
        r"`rule` '.*rule\.json': is not UTF-8 text",
    ),
    Case(
        "preflight-overlap-rule-json-list",
        "traceback",
        _overlap(rule=b"[1, 2]"),
        r"`rule` file '.*rule\.json' holds a JSON list; expected a predict_rule\.json",
    ),
    Case(
        "preflight-overlap-rule-unknown-diagnostic",
        "misleading",
        _overlap(rule=_rule_with("merge", feature="expert_kl_men", threshold=1.0)),
        r"`rule` '.*rule\.json': `merge` reads diagnostic 'expert_kl_men', which the overlap does not measure; "
        r"did you mean 'expert_kl_mean'",
    ),
    Case(
        "preflight-overlap-rule-epsilon-not-measured",
        "misleading",
        _overlap(rule=_rule_with("compose", feature="coactivation_rate@0.05", threshold=0.2)),
        r"`compose` reads 'coactivation_rate@0\.05', but co-activation is measured only at `settings\.epsilons` "
        r"= \[0\.01, 0\.1, 1\.0\]; add 0\.05",
    ),
    Case(
        "preflight-overlap-rule-threshold-missing",
        "traceback",
        _overlap(rule=_rule_with("remedy", feature="projective_error")),
        r"not a verdict rule: remedy: .*`threshold` is needed with `feature` 'projective_error'",
    ),
    Case(
        "preflight-overlap-rule-direction-unknown",
        "silent",
        _overlap(rule=_rule_with("merge", feature="expert_kl_mean", threshold=1.0, direction="under")),
        r"not a verdict rule: merge\.direction: Input should be 'above' or 'below'",
    ),
    # preflight_overlap itself: sources, data and device, with nothing loaded
    Case(
        "preflight-overlap-api-expert-missing",
        "clear",
        _preflight_overlap(experts=["./missing_expert"]),
        r"`experts` '\./missing_expert': no such folder",
    ),
    Case(
        "preflight-overlap-api-data-record-without-text",
        "clear",
        lambda env: _preflight_overlap(data=str(_lines(env, b'{"question": "?"}\n')))(env),
        r"lines\.jsonl:1: a record must be",
    ),
    Case(
        "preflight-overlap-api-rollouts-unknown-expert",
        "traceback",
        _preflight_overlap(rollouts=["expert:nobody"]),
        r"`rollouts` entry 'expert:nobody' names no expert; the experts are \['expert_0', 'expert_1'\]",
    ),
    Case(
        "preflight-overlap-api-cuda-unavailable",
        "clear",
        _preflight_overlap(device="cuda"),
        r"`device` is 'cuda' but no CUDA device is available",
        skip="this machine has a CUDA device" if torch.cuda.is_available() else None,
    ),
    # predict-sweep: every family's compare config, read from the predict config's folder
    Case(
        "preflight-predict-cli-family-without-training",
        "traceback",
        _predict_cli_without_training,
        r"family 'letters': its compare config '.*compare\.yaml' \(with `overrides`\) has no `training\.experts` block",
    ),
    Case(
        "preflight-predict-compare-relative-to-config",
        "traceback",
        _predict(None, name="missing.yaml"),
        r"family 'letters': compare config` '.*/cfg/missing\.yaml': does not exist",
    ),
    Case(
        "preflight-predict-compare-invalid",
        "clear",
        _predict({**COMPARE, "model": {"hidden_size": 63}}),
        r"family 'letters': .*hidden_size.*63",
    ),
    # overlap-sweep: its compare config, read from the sweep config's folder
    Case(
        "preflight-overlap-sweep-without-training",
        "traceback",
        _sweep({key: value for key, value in COMPARE.items() if key != "training"}),
        r"`compare` config '.*/cfg/compare\.yaml' \(with `compare_overrides`\) has no `training\.experts` block",
    ),
]


def _lines(env, data: bytes):
    path = env.tmp / "lines.jsonl"
    path.write_bytes(data)
    return path
