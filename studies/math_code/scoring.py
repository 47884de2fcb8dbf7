"""Two scores for every output: strict reads the answer where the format puts it, lenient anywhere.

Math (gold: an integer):
    strict   the first line that is exactly "The answer is N." holds the gold number
    lenient  the last number of the output (for a mixed output: of the text before its first ```) equals it
Code (gold: the problem's `check`, run in `mergecompose.core.sandbox`):
    strict   the first closed ```python block passes
    lenient  some code block passes: any closed ``` block whatever its language tag, or a block left open
             at the end (an output cut by the token limit)
Mixed: a part of each kind, and the output is right when both parts are (`MixedScore.strict`, `.lenient`).

Neither score gives credit for the format alone: an answer line with a wrong number fails both, and
a block that does not define the function fails its `check`. Strict implies lenient.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from mergecompose.core.sandbox import SandboxLimits, run_tests_many, sandbox_available
from mergecompose.studies.math_code.code_problems import CodeProblem
from mergecompose.studies.math_code.mixed import MixedProblem

ANSWER_LINE_PATTERN = re.compile(r"The answer is (-?\d+)\.")
NUMBER_PATTERN = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")  # a "-" after a digit is a minus sign
CLOSED_BLOCK_PATTERN = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
FENCE = "```"
CODE_LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=5)  # a short function and five asserts


@dataclass(frozen=True)
class Score:
    strict: bool
    lenient: bool


@dataclass(frozen=True)
class MixedScore:
    math: Score
    code: Score

    @property
    def strict(self) -> bool:
        return self.math.strict and self.code.strict

    @property
    def lenient(self) -> bool:
        return self.math.lenient and self.code.lenient


def strict_answer(output: str) -> int | None:
    """The number of the first line that is exactly the answer line, or None."""
    for line in output.splitlines():
        match = ANSWER_LINE_PATTERN.fullmatch(line.strip())
        if match:
            return int(match.group(1))
    return None


def lenient_answer(output: str) -> float | None:
    """The last number in `output` (commas between thousands allowed), or None."""
    numbers = NUMBER_PATTERN.findall(output)
    return float(numbers[-1].replace(",", "")) if numbers else None


def score_math(output: str, answer: int) -> Score:
    """Strict: the answer line holds `answer`; lenient: the last number is `answer`."""
    _check_output(output, "output")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise ValueError(f"`answer` must be an int, got {answer!r}")
    return Score(strict_answer(output) == answer, lenient_answer(output) == answer)


def strict_block(output: str) -> str | None:
    """The body of the first closed ```python block, or None."""
    for match in CLOSED_BLOCK_PATTERN.finditer(output):
        if match.group(1).strip() == "python":
            return match.group(2)
    return None


def code_blocks(output: str) -> list[str]:
    """Every closed ``` block whatever its tag, in order, then a block left open at the end."""
    blocks, end = [], 0
    for match in CLOSED_BLOCK_PATTERN.finditer(output):
        blocks.append(match.group(2))
        end = match.end()
    rest = output[end:]
    if FENCE in rest:
        opened = rest[rest.index(FENCE) + len(FENCE) :]
        if "\n" in opened:
            blocks.append(opened[opened.index("\n") + 1 :])
    return blocks


def score_code(
    outputs: Sequence[str],
    problems: Sequence[CodeProblem],
    limits: SandboxLimits = CODE_LIMITS,
    workers: int = 4,
) -> list[Score]:
    """Each output's strict and lenient pass of its problem's `check`, run in the sandbox (pass@1)."""
    _check_pairs(outputs, problems, CodeProblem)
    return _run_blocks([(strict_block(output), code_blocks(output)) for output in outputs], problems, limits, workers)


def score_mixed(
    outputs: Sequence[str],
    problems: Sequence[MixedProblem],
    limits: SandboxLimits = CODE_LIMITS,
    workers: int = 4,
) -> list[MixedScore]:
    """Both parts of each output: its word problem's answer and its function's tests."""
    _check_pairs(outputs, problems, MixedProblem)
    maths = [
        Score(strict_answer(output) == problem.math.answer, lenient_answer(_before_code(output)) == problem.math.answer)
        for output, problem in zip(outputs, problems, strict=True)
    ]
    codes = _run_blocks(
        [(strict_block(output), code_blocks(output)) for output in outputs],
        [problem.code for problem in problems],
        limits,
        workers,
    )
    return [MixedScore(math, code) for math, code in zip(maths, codes, strict=True)]


def pass_rates(scores: Sequence[Score | MixedScore]) -> dict[str, float]:
    """The fraction of strict and of lenient passes."""
    if not scores:
        raise ValueError("`scores` must hold at least one score, got none")
    return {
        "strict": sum(score.strict for score in scores) / len(scores),
        "lenient": sum(score.lenient for score in scores) / len(scores),
    }


def _before_code(output: str) -> str:
    return output.split(FENCE, 1)[0]


def _run_blocks(
    blocks: Sequence[tuple[str | None, list[str]]],
    problems: Sequence[CodeProblem],
    limits: SandboxLimits,
    workers: int,
) -> list[Score]:
    """Run every distinct (block, problem) once; strict passes if its block does, lenient if any block does."""
    unavailable = sandbox_available()
    if unavailable is not None:
        raise OSError(f"code scoring needs the sandbox, which cannot run here: {unavailable}")
    samples: dict[tuple[str, str], int] = {}
    for (strict, lenient), problem in zip(blocks, problems, strict=True):
        for block in ([strict] if strict is not None else []) + lenient:
            samples.setdefault((f"{block}\n\n{problem.check_code}", problem.check_call), len(samples))
    results = run_tests_many(list(samples), limits, workers)
    errors = [result.detail for result in results if result.status == "error"]
    if errors:
        raise OSError(f"the sandbox did not run {len(errors)} of {len(results)} samples: {errors[0]}")

    def passes(block: str, problem: CodeProblem) -> bool:
        return results[samples[(f"{block}\n\n{problem.check_code}", problem.check_call)]].passed

    return [
        Score(
            strict is not None and passes(strict, problem),
            any(passes(block, problem) for block in lenient),
        )
        for (strict, lenient), problem in zip(blocks, problems, strict=True)
    ]


def _check_output(output: object, name: str) -> None:
    if not isinstance(output, str):
        raise ValueError(f"`{name}` must be a str, got {type(output).__name__}")


def _check_pairs(outputs: Sequence[str], problems: Sequence[object], kind: type) -> None:
    if len(outputs) != len(problems):
        raise ValueError(f"`outputs` must hold one output per problem ({len(problems)}), got {len(outputs)}")
    for index, output in enumerate(outputs):
        _check_output(output, f"outputs[{index}]")
    for index, problem in enumerate(problems):
        if not isinstance(problem, kind):
            raise ValueError(f"`problems[{index}]` must be a {kind.__name__}, got {type(problem).__name__}")
