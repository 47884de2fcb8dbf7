"""Mixed prompts: a worked word problem first, then a function, in one request (the sequential-skills claim).

Each expert can do one part; the composition should do both. A mixed problem pairs a math problem
and a code problem of the same split (so the test split uses only test templates of both kinds); its
reference answer is the worked solution, its answer line, then the function in a ```python block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mergecompose.studies.math_code.code_problems import CodeProblem, code_split
from mergecompose.studies.math_code.math_problems import MathProblem, math_split
from mergecompose.studies.math_code.splits import check_count, check_split

MIXED_MATH_INSTRUCTION = 'Solve it step by step and give the line "The answer is N."'


@dataclass(frozen=True)
class MixedProblem:
    math: MathProblem
    code: CodeProblem

    @property
    def split(self) -> str:
        return self.math.split

    @property
    def prompt(self) -> str:
        return f"First task: {self.math.question}\n{MIXED_MATH_INSTRUCTION}\n\nSecond task: {self.code.prompt}"

    @property
    def answer(self) -> str:
        return f"{self.math.solution}\n\n{self.code.answer}"


def mixed_split(split: str, count: int, seed: int = 0) -> list[MixedProblem]:
    """`count` pairs: distinct math problems and distinct code problems of `split`, paired at random.

    The math and code problems come from streams of their own (seeds apart from `math_split` and
    `code_split` with the same `seed`), so a mixed split does not repeat the single-skill splits' prompts
    in the same order.
    """
    check_split(split)
    check_count(count)
    mixed_seed = 1_000_003 + seed  # a different stream from the single-skill splits of the same seed
    maths = math_split(split, count, mixed_seed)
    codes = code_split(split, count, mixed_seed)
    random.Random(f"mixed/{split}/{seed}").shuffle(codes)
    return [MixedProblem(math, code) for math, code in zip(maths, codes, strict=True)]
