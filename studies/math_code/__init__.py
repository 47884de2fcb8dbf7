"""Data and scoring for the real-model study: a math expert and a code expert on SmolLM2-135M-Instruct.

mergecompose.studies.math_code.math_problems  word problems with worked solutions ("The answer is N.")
mergecompose.studies.math_code.code_problems  one-line function requests with references and tests
mergecompose.studies.math_code.mixed          a word problem, then a function, in one prompt
mergecompose.studies.math_code.scoring        strict and lenient scores (code run in core.sandbox)
mergecompose.studies.math_code.chat_data      chat-format training batches and generation inputs
mergecompose.studies.math_code.splits         the three splits, with disjoint templates

The held-out sizes of the study are `SPLIT_SIZES`; every generator is deterministic in its seed.
"""

from mergecompose.studies.math_code.chat_data import (
    SYSTEM_PROMPT,
    chat_messages,
    generation_inputs,
    tokenize_example,
    training_batch,
)
from mergecompose.studies.math_code.code_problems import CodeProblem, code_split
from mergecompose.studies.math_code.math_problems import MathProblem, math_split
from mergecompose.studies.math_code.mixed import MixedProblem, mixed_split
from mergecompose.studies.math_code.scoring import (
    MixedScore,
    Score,
    pass_rates,
    score_code,
    score_math,
    score_mixed,
)
from mergecompose.studies.math_code.splits import SPLIT_SIZES, SPLITS

__all__ = [
    "SPLITS",
    "SPLIT_SIZES",
    "SYSTEM_PROMPT",
    "CodeProblem",
    "MathProblem",
    "MixedProblem",
    "MixedScore",
    "Score",
    "chat_messages",
    "code_split",
    "generation_inputs",
    "math_split",
    "mixed_split",
    "pass_rates",
    "score_code",
    "score_math",
    "score_mixed",
    "tokenize_example",
    "training_batch",
]
