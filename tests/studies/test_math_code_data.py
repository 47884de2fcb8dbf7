"""The math, code and mixed splits of the real-model study, their scores, and the chat-format training data."""

from __future__ import annotations

import copy
import random
import re
from fractions import Fraction

import pytest
import torch
from transformers import AutoTokenizer

from mergecompose.core.sandbox import run_tests_many
from mergecompose.core.training import IGNORE_INDEX
from mergecompose.integrations.gguf.fetch import fetch_model
from mergecompose.studies.math_code import (
    SPLIT_SIZES,
    SPLITS,
    SYSTEM_PROMPT,
    Score,
    code_split,
    generation_inputs,
    math_split,
    mixed_split,
    pass_rates,
    score_code,
    score_math,
    score_mixed,
    tokenize_example,
    training_batch,
)
from mergecompose.studies.math_code import code_problems as code_module
from mergecompose.studies.math_code import math_problems as math_module
from mergecompose.studies.math_code.chat_data import chat_format, end_of_turn_id, generation_text
from mergecompose.studies.math_code.math_problems import NAMES, expanded_arithmetic

# Each math template's answer from the numbers of its question, in the order they appear there,
# written here apart from the generator's own arithmetic.
RECOMPUTE = {
    "apples": lambda a, b, c, d: a + b * c - d,
    "cookies": lambda a, b, c: Fraction(a * b, c),
    "train_trip": lambda a, b, c, d: a * b + c * d,
    "notebooks": lambda a, b, c: a - b * c,
    "reading": lambda a, b, c, d: d - a * b - c,
    "pencil_boxes": lambda a, b, c: Fraction(a, b) - c,
    "ages": lambda a, b, c: a * b + c,
    "garden": lambda a, b, c, d: a * b - c + d,
    "savings_jars": lambda a, b, c: Fraction(a * b, c),
    "water_tank": lambda a, b, c, d: a - b * c + d,
    "piano": lambda a, b, c: a * b + 2 * a * c,
    "marbles": lambda a, b, c, d: a - b * c + d,
    "tickets": lambda a, b, c, d: a * c + b * d,
    "cake_slices": lambda a, b, c, d: Fraction(a * b - c, d),
    "fuel": lambda a, b, c, d: a * b * c * d,
    "school_teams": lambda a, b, c, d: Fraction(a * b - c, d),
    "stamps": lambda a, b, c: a + (a + b) + c * a,
    "muffins": lambda a, b, c: Fraction(a, b) * c,
    "farm_legs": lambda a, b: 2 * a + 4 * b,
    "profit": lambda a, b, c: a * c - a * b,
    "empty_seats": lambda a, b, c, d: a * b - c - d,
    "pizza_bill": lambda a, b, c: Fraction(b * c, a),
    "crayons": lambda a, b, c: Fraction(a * b - c, 2),
    "pool": lambda a, b, c: Fraction(a - b * c, b),
}
ANSWER_LINE = re.compile(r"The answer is (\d+)\.")


def skeleton(text: str) -> str:
    """A prompt with its numbers, names and quoted strings blanked: what a template fixes."""
    text = re.sub(r"'[^']*'", "'?'", text)
    text = re.sub(r"\d+", "#", text)
    return re.sub("|".join(NAMES), "NAME", text)


@pytest.fixture(scope="module")
def splits():
    return {
        kind: {split: generate(split, SPLIT_SIZES[kind].get(split, 300)) for split in SPLITS}
        for kind, generate in (("math", math_split), ("code", code_split), ("mixed", mixed_split))
    }


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(fetch_model("smollm2-135m-instruct"))


def test_held_out_splits_have_their_sizes_and_distinct_prompts(splits):
    assert SPLIT_SIZES["math"]["test"] >= 200 and SPLIT_SIZES["code"]["test"] >= 150
    assert SPLIT_SIZES["mixed"]["test"] >= 150
    for kind, by_split in splits.items():
        for split, problems in by_split.items():
            assert len(problems) == SPLIT_SIZES[kind].get(split, 300), (kind, split)
            assert len({problem.prompt for problem in problems}) == len(problems), (kind, split)
            assert {problem.split for problem in problems} == {split}


def test_templates_are_disjoint_across_splits(splits):
    for kind, module in (("math", math_module), ("code", code_module)):
        used = {split: {problem.template for problem in splits[kind][split]} for split in SPLITS}
        declared = {split: {template.__name__ for template in module.TEMPLATE_SPLITS[split]} for split in SPLITS}
        assert used == declared, kind  # every template of a split is used, and no other
        skeletons = {split: {skeleton(problem.prompt) for problem in splits[kind][split]} for split in SPLITS}
        for first, second in (("train", "validation"), ("train", "test"), ("validation", "test")):
            assert not declared[first] & declared[second], (kind, first, second)
            assert not skeletons[first] & skeletons[second], (kind, first, second)  # not only by name
    for split in SPLITS:
        mixed = splits["mixed"][split]
        assert {problem.math.template for problem in mixed} <= {t.__name__ for t in math_module.TEMPLATE_SPLITS[split]}
        assert {problem.code.template for problem in mixed} <= {t.__name__ for t in code_module.TEMPLATE_SPLITS[split]}
    assert len(math_module.TEMPLATE_SPLITS["train"]) >= 10 and len(code_module.TEMPLATE_SPLITS["train"]) >= 10


PROCEDURAL = {"collection", "rates", "shopping", "comparison"}  # train only: stories of varying shape
STEP = re.compile(r"(\d+(?: [-+*/] \d+)+) = (\d+)")  # "a + b + c = d" in a worked step


def test_every_answer_line_equals_the_answer_recomputed_from_the_question(splits):
    templates = {template.__name__ for split in SPLITS for template in math_module.TEMPLATE_SPLITS[split]}
    assert set(RECOMPUTE) | PROCEDURAL == templates and not set(RECOMPUTE) & PROCEDURAL
    problems = [problem for split in SPLITS for problem in splits["math"][split]]
    problems += [problem.math for split in SPLITS for problem in splits["mixed"][split]]
    assert {problem.template for problem in problems if problem.split != "train"}.isdisjoint(PROCEDURAL)
    for problem in problems:
        numbers = [int(number) for number in re.findall(r"\d+", problem.question)]
        if problem.template in PROCEDURAL:
            # No fixed formula: every step's arithmetic is checked, and the last step's result is the answer.
            steps = STEP.findall(problem.solution)
            assert steps, problem.solution
            for expression, result in steps:
                assert Fraction(eval(expression)) == int(result), problem.solution  # noqa: S307 (digits and + - * /)
            expected = int(steps[-1][1])
        else:
            expected = RECOMPUTE[problem.template](*numbers)
        assert expected == int(expected) and 0 <= expected <= 999, problem.question  # exact, small, not negative
        last_line = problem.solution.splitlines()[-1]
        assert ANSWER_LINE.fullmatch(last_line), last_line
        assert int(ANSWER_LINE.fullmatch(last_line).group(1)) == expected == problem.answer, problem.question
        assert all(1 <= number <= 999 for number in numbers), problem.question
        assert len(problem.solution.splitlines()) >= 3  # worked steps before the answer line
    # All four operations are asked for somewhere.
    solutions = "\n".join(problem.solution for problem in problems)
    assert all(f" {operator} " in solutions for operator in "+-*/")


def test_problem_types_chains_the_standard_question_types_with_right_arithmetic(splits):
    """The optional train template: every step's arithmetic right, the last step's result the answer, two steps
    or more, the module's ranges; every question type asked, its number stated first in some stories and last
    in others; no story of it shares a skeleton with a held-out one."""
    problems = [p for p in math_split("train", 3000, 0, 1, 1) if p.template == "problem_types"]
    assert len(problems) > 150
    for problem in problems:
        steps = STEP.findall(problem.solution)
        assert len(steps) >= 2 and len(problem.solution.splitlines()) >= 3, problem.solution
        for expression, result in steps:
            assert Fraction(eval(expression)) == int(result), problem.solution  # noqa: S307 (digits and + - * /)
        assert int(steps[-1][1]) == problem.answer and 0 <= problem.answer <= 999, problem.question
        assert all(1 <= int(number) <= 999 for number in re.findall(r"\d+", problem.question)), problem.question
    asks = {
        "missing": r"How many more \w[\w ]* (does \w+ need|fit in)\?$",
        "measure": r"How many \w+ does \w+ fill\?$",
        "share": r"does each of the \w+ get\?$",
        "difference": r"does \w+ have than \w+\?$",
        "result": r"(have|are there) now\?$",
    }
    for kind, ask in asks.items():
        assert any(re.search(ask, p.question) for p in problems), kind
    givens = r"(wants \d+|has room for|packs the|shares all the)"
    opening = [bool(re.search(givens, p.question.split(". ")[0])) for p in problems if re.search(givens, p.question)]
    assert any(opening) and not all(opening)  # the number the question needs comes first or last
    held_out = {skeleton(p.prompt) for split in ("validation", "test") for p in splits["math"][split]}
    assert not {skeleton(p.prompt) for p in problems} & held_out


def test_expanded_arithmetic_works_each_two_number_step_out_by_place_value(splits):
    assert expanded_arithmetic("It has 21 * 3 = 63 legs.") == "It has 21 * 3 = 20 * 3 + 1 * 3 = 60 + 3 = 63 legs."
    assert expanded_arithmetic("47 + 35 = 82") == "47 + 35 = 47 + 30 + 5 = 77 + 5 = 82"
    assert expanded_arithmetic("82 - 35 = 47.") == "82 - 35 = 82 - 30 - 5 = 52 - 5 = 47."
    kept = "3 * 4 = 12, 40 * 2 = 80, 50 + 30 = 80, 9 - 4 = 5, 144 / 8 = 18, 1 + 2 + 30 = 33"
    assert expanded_arithmetic(kept) == kept  # one-digit or round numbers, a division, a longer sum
    for problem in splits["math"]["train"]:
        expanded = expanded_arithmetic(problem.solution)
        assert expanded.splitlines()[-1] == problem.solution.splitlines()[-1]  # the answer line is kept
        for chain in re.findall(r"\d+(?: [-+*/] \d+)+(?: = \d+(?: [-+*/] \d+)*)+", expanded):
            values = {Fraction(eval(part)) for part in chain.split(" = ")}  # noqa: S307 (digits and + - * /)
            assert len(values) == 1, chain  # every form of a step has the same value


def test_procedural_code_templates_ask_for_other_functions_than_the_held_out_ones():
    """The train split's composed requests (a filter, a map, an aggregate ...) never name a held-out function."""
    train = code_split("train", 1500)
    procedural = [problem for problem in train if problem.template in ("number_query", "word_query", "text_transform")]
    assert len(procedural) > 1000 and len({problem.function_name for problem in procedural}) > 100
    held_out = {t.__name__ for split in ("validation", "test") for t in code_module.TEMPLATE_SPLITS[split]}
    assert not {problem.function_name for problem in train} & held_out
    for problem in procedural:
        assert problem.reference_solution.startswith(f"def {problem.function_name}(")
        assert problem.reference_solution != problem.wrong_solution


def test_generators_are_deterministic_in_their_seed():
    assert math_split("train", 30, seed=3) == math_split("train", 30, seed=3)
    assert code_split("train", 30, seed=3) == code_split("train", 30, seed=3)
    assert mixed_split("test", 10, seed=3) == mixed_split("test", 10, seed=3)
    assert math_split("train", 30, seed=3) != math_split("train", 30, seed=4)
    assert code_split("train", 30, seed=3) != code_split("train", 30, seed=4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"`split` must be one of train, validation, test, got 'dev'"):
        math_split("dev", 5)
    with pytest.raises(ValueError, match=r"`count` must be an integer >= 1, got 0"):
        code_split("test", 0)
    with pytest.raises(ValueError, match=r"`count` must be at most the \d+ distinct problems"):
        code_split("validation", 100_000)


def test_reference_solutions_pass_their_tests_and_near_misses_fail():
    """One problem per code template (21), each reference and its near miss, in the sandbox at once."""
    rng = random.Random(7)
    problems = [code_module.code_problem(t, split, rng) for split in SPLITS for t in code_module.TEMPLATE_SPLITS[split]]
    programs = [(f"{p.reference_solution}\n\n{p.check_code}", p.check_call) for p in problems]
    programs += [(f"{p.wrong_solution}\n\n{p.check_code}", p.check_call) for p in problems]
    results = run_tests_many(programs, workers=4)
    statuses = [result.status for result in results]
    assert statuses == ["passed"] * len(problems) + ["failed"] * len(problems), list(zip(problems * 2, statuses))


def test_math_scores_strict_and_lenient_on_written_outputs():
    right = "Maya has 40 + 2 = 42 apples.\nThe answer is 42."
    assert score_math(right, 42) == Score(strict=True, lenient=True)
    assert score_math("The answer is 41.", 42) == Score(False, False)  # the format alone carries nothing
    assert score_math("Maya has 42 apples in the end.", 42) == Score(False, True)  # buried in text
    assert score_math("The answer is: 42", 42) == Score(False, True)  # not the answer line
    assert score_math("The answer is 42.\nOr maybe 43.", 42) == Score(True, False)
    assert score_math("40 + 2 = 42. The answer is 42.", 42) == Score(False, True)  # not a line of its own
    assert score_math("The total is 1,042 dollars.", 1042) == Score(False, True)
    assert score_math("50-8", 8) == Score(False, True)  # a minus after a digit is an operator, not a sign
    assert score_math("It is -3.", -3) == Score(False, True)
    assert score_math("", 42) == Score(False, False)
    with pytest.raises(ValueError, match=r"`answer` must be an int, got '42'"):
        score_math(right, "42")


def test_code_and_mixed_scores_strict_and_lenient_on_written_outputs():
    code = code_split("test", 1, seed=5)[0]
    mixed = mixed_split("test", 1, seed=5)[0]
    reference, wrong = code.reference_solution, code.wrong_solution
    outputs = {
        "the format": ((True, True), code.answer),
        "no language tag": ((False, True), f"```\n{reference}\n```"),
        "a near miss in the format": ((False, False), f"```python\n{wrong}\n```"),
        "no function in the format": ((False, False), "```python\nprint('hello')\n```"),
        "the second python block": ((False, True), f"```python\n{wrong}\n```\nOr:\n```python\n{reference}\n```"),
        "a block left open": ((False, True), f"Here it is:\n```python\n{reference}\n"),
        "no block at all": ((False, False), reference),
        "an early exit": ((False, False), f"```python\n{reference}\nraise SystemExit(0)\n```"),
    }
    math = mixed.math.solution
    mixed_outputs = {
        "the format": ((True, True), mixed.answer),
        "a wrong answer line": ((False, False), f"The answer is {mixed.math.answer + 1}.\n\n{mixed.code.answer}"),
        "a buried number": ((False, True), f"So it is {mixed.math.answer} in all.\n\n{mixed.code.answer}"),
        "a near miss": ((False, False), f"{math}\n\n```python\n{mixed.code.wrong_solution}\n```"),
        "no function": ((False, False), math),
        "an untagged block": ((False, True), f"{math}\n\n```\n{mixed.code.reference_solution}\n```"),
    }
    code_scores = score_code([output for _, output in outputs.values()], [code] * len(outputs))
    mixed_scores = score_mixed([output for _, output in mixed_outputs.values()], [mixed] * len(mixed_outputs))
    for (name, (expected, _)), score in zip(outputs.items(), code_scores, strict=True):
        assert (score.strict, score.lenient) == expected, name
    for (name, (expected, _)), score in zip(mixed_outputs.items(), mixed_scores, strict=True):
        assert (score.strict, score.lenient) == expected, name
    # Each part alone: a math-only answer has the math part, a code-only answer the code part.
    assert mixed_scores[4].math.strict and not mixed_scores[4].code.lenient
    assert mixed_scores[1].code.strict and not mixed_scores[1].math.lenient
    assert pass_rates(code_scores) == {"strict": 1 / 8, "lenient": 4 / 8}
    with pytest.raises(ValueError, match=r"`outputs` must hold one output per problem \(2\), got 1"):
        score_code([code.answer], [code, code])


def test_training_labels_cover_exactly_the_answer_and_its_closing_end_of_turn(tokenizer):
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2 and tokenizer.padding_side == "right"
    pairs = [(problem.prompt, problem.solution) for problem in math_split("train", 2)]
    pairs += [(problem.prompt, problem.answer) for problem in [*code_split("train", 2), *mixed_split("validation", 1)]]
    batch = training_batch(tokenizer, pairs)
    input_ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # (B, T) each
    assert input_ids.shape == mask.shape == labels.shape == (len(pairs), input_ids.shape[1])
    lengths = mask.sum(dim=1)
    assert (lengths < input_ids.shape[1]).sum() >= len(pairs) - 1  # every row but the longest is padded
    for row, (prompt, answer) in enumerate(pairs):
        length = int(lengths[row])
        assert mask[row, :length].all() and not mask[row, length:].any()  # padded on the right
        assert (input_ids[row, length:] == 2).all() and (labels[row, length:] == IGNORE_INDEX).all()  # pad == eos
        labelled = (labels[row] != IGNORE_INDEX).nonzero().flatten()
        start = int(labelled[0])
        assert labelled.tolist() == list(range(start, length))  # one run, up to the last real token
        assert (labels[row, labelled] == input_ids[row, labelled]).all()
        assert int(input_ids[row, length - 1]) == 2  # the closing <|im_end|> carries a label
        assert tokenizer.decode(input_ids[row, start:length]) == answer + "<|im_end|>"
        assert tokenizer.decode(input_ids[row, :start]).endswith("<|im_start|>assistant\n")
        # The same tokens as the chat template's text of the whole conversation, less its final newline.
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": answer},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        assert input_ids[row, :length].tolist() == tokenizer.encode(text)[:-1]
        # No system prompt given: the template inserts its default, the one used here.
        assert text == tokenizer.apply_chat_template(messages[1:], tokenize=False)
        ids, example_labels = tokenize_example(tokenizer, prompt, answer)
        assert ids == input_ids[row, :length].tolist() and example_labels == labels[row, :length].tolist()
    with pytest.raises(ValueError, match=r"`pairs\[0\]` is \d+ tokens, more than `max_length` 8"):
        training_batch(tokenizer, pairs, max_length=8)


def test_generation_inputs_pad_on_the_left(tokenizer):
    prompts = ["Short.", math_split("test", 1)[0].prompt]
    batch = generation_inputs(tokenizer, prompts)
    input_ids, mask = batch["input_ids"], batch["attention_mask"]  # (B, T)
    assert mask[1].all() and not mask[0, 0] and mask[0, -1]
    assert torch.equal(input_ids[:, -3:], input_ids[1:, -3:].expand(2, 3))  # each row ends "<|im_start|>assistant\n"
    assert (input_ids[0][mask[0] == 0] == 2).all()
    assert tokenizer.decode(input_ids[1]).endswith("<|im_start|>assistant\n")


def test_a_gemma_tokenizer_gets_gemma_s_turns(tokenizer):
    """A tokenizer with no chat template but Gemma's turn markers (as Gemma-3-270M's GGUF gives): Gemma's turns, no
    system turn, the answer closed by `<end_of_turn>`; without either format, one clear error."""
    gemma = copy.deepcopy(tokenizer)
    gemma.chat_template = None
    gemma.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    end = gemma.convert_tokens_to_ids("<end_of_turn>")
    assert chat_format(gemma) == "gemma" and chat_format(tokenizer) == "chatml"
    assert end_of_turn_id(gemma) == end and end_of_turn_id(tokenizer) == 2
    text = generation_text(gemma, "Sort 3, 1, 2.")
    assert text == f"{gemma.bos_token or ''}<start_of_turn>user\nSort 3, 1, 2.<end_of_turn>\n<start_of_turn>model\n"
    ids, labels = tokenize_example(gemma, "Sort 3, 1, 2.", "1, 2, 3")
    start = next(index for index, label in enumerate(labels) if label != IGNORE_INDEX)
    assert ids[-1] == end and labels[start:] == ids[start:]
    assert gemma.decode(ids[start:]) == "1, 2, 3<end_of_turn>"
    assert ids[:start] == gemma.encode(text, add_special_tokens=False)
    batch = generation_inputs(gemma, ["Short.", "Sort 3, 1, 2."])
    assert gemma.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()]).endswith("<start_of_turn>model\n")
    neither = copy.deepcopy(tokenizer)
    neither.chat_template = None
    with pytest.raises(ValueError, match=r"must be a ChatML tokenizer with its chat template .* got neither"):
        end_of_turn_id(neither)
