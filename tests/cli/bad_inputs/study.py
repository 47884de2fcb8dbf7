"""Bad input to the real-model study (`task.type: math_code`): a config without the code-execution opt-in, and
one whose composition names an expert it does not train; both refused before anything is fetched or trained."""

from __future__ import annotations

import yaml

from bad_inputs import Case, Cli


def _study(env, **changes) -> Cli:
    fields = {
        "task": {"type": "math_code"},
        "base": str(env.checkpoints / "base"),
        "experts": {"math": {"skill": "math"}, "code": {"skill": "code"}},
        "compositions": {"compose": {"experts": ["math", "code"]}},
        "allow_code_execution": True,
        **changes,
    }
    path = env.tmp / "study.yaml"
    path.write_text(yaml.safe_dump(fields))
    return Cli(["compare", str(path), "--out", str(env.tmp / "out")], inputs=[path])


CASES = [
    Case(
        "study-without-code-execution-opt-in",
        "clear",
        lambda env: _study(env, allow_code_execution=False),
        r"run model-written code: set `allow_code_execution: true`",
    ),
    Case(
        "study-composition-of-an-untrained-expert",
        "clear",
        lambda env: _study(env, compositions={"compose": {"experts": ["math", "poetry"]}}),
        r"`compositions.compose.experts` must name experts of `experts` \(\['code', 'math'\]\), got \['poetry'\]",
    ),
]
