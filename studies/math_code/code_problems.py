"""Short Python functions asked for in one line, each with a reference solution, a near miss and tests.

A template is one kind of function (`count_above`, `clamp`, ...) with parameters drawn per problem
(the threshold, the separator, the letters), so its one-line description differs from problem to
problem. The templates fall into three disjoint sets (`TEMPLATE_SPLITS`): train, validation and test.
Every problem carries a `check(candidate)` function of asserts on 5 inputs, with the expected values
computed here in Python; the reference solution passes them and the near miss (`wrong_solution`, a
plausible slip: `>=` for `>`, the wrong end of a string) fails at least one (the tests run both in
`mergecompose.core.sandbox`). Inputs stay small: lists of 0..6 integers in 0..30, words of 2..7 letters.
Problems are deterministic in `(split, count, seed)`.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mergecompose.studies.math_code.splits import check_count, check_split, distinct_draws

CODE_INSTRUCTION = "Answer with the function in one ```python code block."
ORDINALS = {2: "second", 3: "third", 4: "fourth", 5: "fifth"}


@dataclass(frozen=True)
class CodeProblem:
    """One function to write: `prompt` asks for `function_name(arguments)`; `check_code` defines `check`."""

    template: str
    split: str
    function_name: str
    arguments: str
    description: str
    reference_solution: str  # the function's source
    wrong_solution: str  # a near miss that fails `check`
    check_code: str  # `def check(candidate): assert ...`

    @property
    def request(self) -> str:
        return f"Write a Python function `{self.function_name}({self.arguments})` that {self.description}"

    @property
    def prompt(self) -> str:
        return f"{self.request}\n{CODE_INSTRUCTION}"

    @property
    def answer(self) -> str:
        """The reference completion, in the format the prompt asks for."""
        return f"```python\n{self.reference_solution}\n```"

    @property
    def check_call(self) -> str:
        return f"check({self.function_name})"


Case = tuple[tuple[object, ...], object]  # (arguments, expected result)


@dataclass(frozen=True)
class Spec:
    """What a template draws: the description, the two bodies and (arguments, expected) cases."""

    arguments: str
    description: str
    body: str  # the reference's body after `def name(arguments):\n    `
    wrong: str  # the near miss's body
    cases: list[Case]
    name: str | None = None  # the function's name, if not the template's


def _numbers(rng: random.Random, low: int = 0, high: int = 30, size: tuple[int, int] = (0, 6)) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(*size))]


def _word(rng: random.Random, letters: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))


def _sentence(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(1, 5)))


def _cases(solve: Callable[..., object], inputs: Sequence[tuple[object, ...]]) -> list[Case]:
    return [(arguments, solve(*arguments)) for arguments in inputs]


# Train templates.


def add_to_each(rng: random.Random) -> Spec:
    k = rng.randint(1, 40)
    inputs = [([rng.randint(0, 30)],), *((_numbers(rng),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns a new list with {k} added to every element of `numbers`.",
        f"return [x + {k} for x in numbers]",
        f"return [x - {k} for x in numbers]",
        _cases(lambda numbers: [x + k for x in numbers], inputs),
    )


def count_above(rng: random.Random) -> Spec:
    k = rng.randint(0, 30)
    inputs = [([k, k + 1],), *((_numbers(rng),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns how many elements of `numbers` are greater than {k}.",
        f"return sum(1 for x in numbers if x > {k})",
        f"return sum(1 for x in numbers if x >= {k})",
        _cases(lambda numbers: sum(1 for x in numbers if x > k), inputs),
    )


def join_repeated(rng: random.Random) -> Spec:
    k, separator = rng.randint(2, 6), rng.choice((", ", "-", " ", "+", "/", "; ", "|", "."))
    inputs = [(_word(rng),) for _ in range(5)]
    return Spec(
        "text",
        f"returns `text` repeated {k} times, with {separator!r} between the copies.",
        f"return {separator!r}.join([text] * {k})",
        f"return text * {k}",
        _cases(lambda text: separator.join([text] * k), inputs),
    )


def sum_divisible(rng: random.Random) -> Spec:
    k = rng.randint(2, 15)
    inputs = [([k, 1],), *((_numbers(rng),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns the sum of the elements of `numbers` that are divisible by {k}.",
        f"return sum(x for x in numbers if x % {k} == 0)",
        f"return sum(x for x in numbers if x % {k} != 0)",
        _cases(lambda numbers: sum(x for x in numbers if x % k == 0), inputs),
    )


def clamp(rng: random.Random) -> Spec:
    low = rng.randint(0, 10)
    high = low + rng.randint(5, 20)
    inputs = [(low - 3,), (high + 2,), *((rng.randint(0, 40),) for _ in range(3))]
    return Spec(
        "x",
        f"returns `x` limited to the range from {low} to {high}: {low} if it is smaller, {high} if it is larger.",
        f"return max({low}, min({high}, x))",
        f"return min({high}, x)",
        _cases(lambda x: max(low, min(high, x)), inputs),
    )


def last_chars(rng: random.Random) -> Spec:
    k = rng.randint(1, 9)
    inputs = [("abcdefghij"[: k + 2],), *((_word(rng),) for _ in range(4))]
    return Spec(
        "text",
        f"returns the last {k} characters of `text` (all of it if it is shorter).",
        f"return text[-{k}:]",
        f"return text[:{k}]",
        _cases(lambda text: text[-k:], inputs),
    )


def scale_each(rng: random.Random) -> Spec:
    k = rng.randint(2, 15)
    inputs = [([3],), *((_numbers(rng),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns a new list with every element of `numbers` multiplied by {k}.",
        f"return [x * {k} for x in numbers]",
        f"return [x + {k} for x in numbers]",
        _cases(lambda numbers: [x * k for x in numbers], inputs),
    )


def count_letter(rng: random.Random) -> Spec:
    letter = rng.choice(string.ascii_lowercase)
    inputs = [(letter + "x" + letter,), *((_word(rng, "abcdefgh"),) for _ in range(4))]
    return Spec(
        "text",
        f"returns how many times the letter {letter!r} occurs in `text`.",
        f"return text.count({letter!r})",
        f"return text[1:].count({letter!r})",
        _cases(lambda text: text.count(letter), inputs),
    )


def first_index_above(rng: random.Random) -> Spec:
    k = rng.randint(0, 30)
    inputs = [([k, k + 5, k + 1],), ([k],), *((_numbers(rng),) for _ in range(3))]
    return Spec(
        "numbers",
        f"returns the index of the first element of `numbers` greater than {k}, or -1 if there is none.",
        f"return next((i for i, x in enumerate(numbers) if x > {k}), -1)",
        f"return next((x for x in numbers if x > {k}), -1)",
        _cases(lambda numbers: next((i for i, x in enumerate(numbers) if x > k), -1), inputs),
    )


def every_kth(rng: random.Random) -> Spec:
    k = rng.randint(2, 5)
    inputs = [(list(range(1, 2 * k + 2)),), *((_numbers(rng, size=(1, 9)),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns every {ORDINALS[k]} element of `numbers`, starting with the first.",
        f"return numbers[::{k}]",
        f"return numbers[1::{k}]",
        _cases(lambda numbers: numbers[::k], inputs),
    )


# Procedural train templates: each composes a function from pools of parts (a filter, a map, an
# aggregate; a word test; a string transform), so the train split asks for many more kinds of function
# than the fixed templates above. None of them asks for what a validation or test template asks for:
# no range filters, letter sets, digit sums, word-order reversals, word lengths, replacements, padding,
# running totals, products or pairwise sums.

Part = tuple[str, str, str]  # (name slug, words in the description, code)


def _composed(
    name: str, arguments: str, description: str, body: str, wrong: str, inputs: Sequence[tuple[object, ...]]
) -> Spec | None:
    """The spec of `return body`, its expected values computed by running it; None if `wrong` passes too."""
    solve, miss = _compiled(arguments, body), _compiled(arguments, wrong)
    cases = _cases(solve, inputs)
    if all(miss(*arguments) == expected for arguments, expected in cases):
        return None
    return Spec(arguments, description, f"return {body}", f"return {wrong}", cases, name)


def _compiled(arguments: str, body: str) -> Callable[..., object]:
    """The function `lambda arguments: body` (the generator's own expressions, never a model's)."""
    return eval(f"lambda {arguments}: {body}")  # noqa: S307


def _number_filters(k: int) -> list[Part]:
    return [
        ("above", f"greater than {k}", f"x > {k}"),
        ("below", f"less than {k}", f"x < {k}"),
        ("at_least", f"at least {k}", f"x >= {k}"),
        ("at_most", f"at most {k}", f"x <= {k}"),
        ("even", "even", "x % 2 == 0"),
        ("odd", "odd", "x % 2 == 1"),
        ("not", f"not equal to {k}", f"x != {k}"),
    ]


def _number_maps(m: int) -> list[Part]:
    return [
        ("plus", f"plus {m}", f"x + {m}"),
        ("minus", f"minus {m}", f"x - {m}"),
        ("times", f"times {m}", f"x * {m}"),
        ("squared", "squared", "x * x"),
        ("halved", "halved and rounded down", "x // 2"),
    ]


def number_query(rng: random.Random) -> Spec:
    """A list, sum, count, maximum, any or all over the elements of `numbers` that pass a filter, maybe mapped."""
    while True:
        k, m = rng.randint(0, 20), rng.randint(2, 9)
        test_name, test, condition = rng.choice(_number_filters(k))
        map_name, mapped, expression = rng.choice(_number_maps(m))
        negated = f"not ({condition})"
        aggregate = rng.choice(("list", "sum", "count", "max", "any", "all"))
        if aggregate == "list":
            description = f"returns a list of each element of `numbers` that is {test}, {mapped}, in their order."
            body, wrong = (
                f"[{expression} for x in numbers if {condition}]",
                f"[{expression} for x in numbers if {negated}]",
            )
        elif aggregate == "sum":
            description = f"returns the sum of the elements of `numbers` that are {test}, each {mapped} first."
            body, wrong = f"sum({expression} for x in numbers if {condition})", f"sum({expression} for x in numbers)"
        elif aggregate == "count":
            description = f"returns how many elements of `numbers` are {test}."
            body, wrong = f"sum(1 for x in numbers if {condition})", f"sum(1 for x in numbers if {negated})"
        elif aggregate == "max":
            description = f"returns the largest element of `numbers` that is {test}, or -1 if there is none."
            body, wrong = f"max((x for x in numbers if {condition}), default=-1)", "max(numbers, default=-1)"
        elif aggregate == "any":
            description = f"returns True if some element of `numbers` is {test}, and False otherwise."
            body, wrong = f"any({condition} for x in numbers)", f"all({condition} for x in numbers)"
        else:
            description = f"returns True if every element of `numbers` is {test}, and False otherwise."
            body, wrong = f"all({condition} for x in numbers)", f"any({condition} for x in numbers)"
        inputs = [([k - 1, k, k + 1, k + 2],), ([],), *((_numbers(rng),) for _ in range(3))]
        mapped_name = f"{map_name}_" if aggregate in ("list", "sum") else ""
        name = f"{aggregate}_{mapped_name}{test_name}".replace("list_", "keep_").replace("max_", "largest_")
        spec = _composed(name, "numbers", description, body, wrong, inputs)
        if spec is not None:
            return spec


def word_query(rng: random.Random) -> Spec:
    """A list, count or joined string of the words of `sentence` that pass a letter test, maybe transformed."""
    while True:
        c = rng.choice("abcdefgh")
        tests = [
            (f"starting_{c}", f"start with {c!r}", f"word.startswith({c!r})"),
            (f"ending_{c}", f"end with {c!r}", f"word.endswith({c!r})"),
            (f"with_{c}", f"contain the letter {c!r}", f"{c!r} in word"),
        ]
        maps = [
            ("words", "", "word"),
            ("upper_words", " in upper case", "word.upper()"),
            ("reversed_words", ", each reversed", "word[::-1]"),
            ("capitalized_words", ", each with its first letter in upper case", "word.capitalize()"),
            ("initials", ", each as its first letter", "word[0]"),
        ]
        test_name, test, condition = rng.choice(tests)
        map_name, mapped, expression = rng.choice(maps)
        separator = rng.choice((" ", "-", ", ", "_", "+", ";"))
        aggregate = rng.choice(("list", "count", "join"))
        words = f"the words of `sentence` (separated by spaces) that {test}"
        name = f"{aggregate}_{map_name}_{test_name}".replace("list_", "")
        if aggregate == "list":
            description = f"returns a list of {words}{mapped}, in their order."
            body = f"[{expression} for word in sentence.split() if {condition}]"
            wrong = f"[{expression} for word in sentence.split() if not {condition}]"
        elif aggregate == "count":
            name = f"count_words_{test_name}"
            description = f"returns how many words of `sentence` (separated by spaces) {test}."
            body = f"sum(1 for word in sentence.split() if {condition})"
            wrong = f"sum(1 for word in sentence.split() if not {condition})"
        else:
            description = f"returns {words}{mapped}, joined by {separator!r}."
            body = f"{separator!r}.join({expression} for word in sentence.split() if {condition})"
            wrong = f"{separator!r}.join({expression} for word in sentence.split())"
        inputs = [(f"{c}ab b{c} cd",), *((_sentence(rng),) for _ in range(4))]
        spec = _composed(name, "sentence", description, body, wrong, inputs)
        if spec is not None:
            return spec


def text_transform(rng: random.Random) -> Spec:
    """One change to the string `text`, or one question about it."""
    while True:
        k, c, extra = rng.randint(2, 4), rng.choice("abcdefgh"), rng.choice(("!", "?", "s", "ing", "ed", "..."))
        transforms = [
            ("shout", "in upper case", "text.upper()", "text.lower()"),
            ("mirror", "reversed", "text[::-1]", "text"),
            ("stretch", f"with each character repeated {k} times", f"''.join(ch * {k} for ch in text)", f"text * {k}"),
            ("add_suffix", f"with {extra!r} added at the end", f"text + {extra!r}", f"{extra!r} + text"),
            ("add_prefix", f"with {extra!r} added at the start", f"{extra!r} + text", f"text + {extra!r}"),
            ("capitalize_first", "with its first letter in upper case", "text[:1].upper() + text[1:]", "text.upper()"),
            ("even_positions", "with only the characters at even indices (0, 2, ...)", "text[::2]", "text[1::2]"),
            ("drop_start", f"without its first {k} characters", f"text[{k}:]", f"text[:{k}]"),
            (
                "remove_letter",
                f"with every {c!r} removed",
                f"''.join(ch for ch in text if ch != {c!r})",
                f"text.replace({c!r}, '', 1)",
            ),
        ]
        questions = [
            (
                "starts_with",
                f"True if `text` starts with {c!r}, and False otherwise",
                f"text.startswith({c!r})",
                f"{c!r} in text",
            ),
            (
                "is_palindrome",
                "True if `text` reads the same backwards, and False otherwise",
                "text == text[::-1]",
                "len(text) % 2 == 1",
            ),
            (
                "find_letter",
                f"the index of the first {c!r} in `text`, or -1 if there is none",
                f"text.find({c!r})",
                f"text.rfind({c!r})",
            ),
            ("scaled_length", f"the length of `text` times {k}", f"len(text) * {k}", f"len(text) + {k}"),
        ]
        if rng.random() < 0.6:
            name, words, body, wrong = rng.choice(transforms)
            description = (
                f"returns a copy of `text` {words}." if words.startswith("with") else f"returns `text` {words}."
            )
        else:
            name, words, body, wrong = rng.choice(questions)
            description = f"returns {words}."
        inputs = [(f"{c}x{c}y{c}",), ("aba",), *((_word(rng, "abcdefgh"),) for _ in range(3))]
        spec = _composed(name, "text", description, body, wrong, inputs)
        if spec is not None:
            return spec


# Validation templates.


def replace_letter(rng: random.Random) -> Spec:
    old, new = rng.sample("abcdefgh", 2)
    inputs = [(old + "x" + old,), *((_word(rng, "abcdefgh"),) for _ in range(4))]
    return Spec(
        "text",
        f"returns `text` with every {old!r} replaced by {new!r}.",
        f"return text.replace({old!r}, {new!r})",
        f"return text.replace({old!r}, {new!r}, 1)",
        _cases(lambda text: text.replace(old, new), inputs),
    )


def count_long_words(rng: random.Random) -> Spec:
    k = rng.randint(2, 6)
    inputs = [("a" * k + " " + "b" * (k + 1),), *((_sentence(rng),) for _ in range(4))]
    return Spec(
        "sentence",
        f"returns how many words of `sentence` (separated by spaces) are longer than {k} letters.",
        f"return sum(1 for word in sentence.split() if len(word) > {k})",
        f"return sum(1 for word in sentence.split() if len(word) >= {k})",
        _cases(lambda sentence: sum(1 for word in sentence.split() if len(word) > k), inputs),
    )


def running_total(rng: random.Random) -> Spec:
    k = rng.randint(1, 30)
    inputs = [([1, 2],), *((_numbers(rng),) for _ in range(4))]
    body = f"totals, total = [], {k}\n    for x in numbers:\n        total += x\n        totals.append(total)\n"
    return Spec(
        "numbers",
        f"returns the running totals of `numbers`, starting from {k}: element i is {k} plus the first i + 1 elements.",
        body + "    return totals",
        body.replace(f"[], {k}", "[], 0") + "    return totals",
        _cases(lambda numbers: [k + sum(numbers[: i + 1]) for i in range(len(numbers))], inputs),
    )


def pad_left(rng: random.Random) -> Spec:
    k, fill = rng.randint(4, 12), rng.choice("*.#0-_")
    inputs = [("ab",), *((_word(rng),) for _ in range(4))]
    return Spec(
        "text",
        f"returns `text` padded on the left with {fill!r} to a length of {k} (unchanged if it is that long).",
        f"return text.rjust({k}, {fill!r})",
        f"return text.ljust({k}, {fill!r})",
        _cases(lambda text: text.rjust(k, fill), inputs),
    )


def product_below(rng: random.Random) -> Spec:
    k = rng.randint(2, 15)
    inputs = [([k, 2],), *((_numbers(rng, 1, 12, (0, 4)),) for _ in range(4))]
    body = f"product = 1\n    for x in numbers:\n        if x < {k}:\n            product *= x\n"
    return Spec(
        "numbers",
        f"returns the product of the elements of `numbers` that are less than {k}, or 1 if there are none.",
        body + "    return product",
        body.replace(f"x < {k}", f"x <= {k}") + "    return product",
        _cases(lambda numbers: _product([x for x in numbers if x < k]), inputs),
    )


def _product(numbers: list[int]) -> int:
    product = 1
    for x in numbers:
        product *= x
    return product


# Test templates.


def keep_between(rng: random.Random) -> Spec:
    low = rng.randint(0, 10)
    high = low + rng.randint(3, 15)
    inputs = [([low, high, high + 1],), *((_numbers(rng),) for _ in range(4))]
    return Spec(
        "numbers",
        f"returns the elements of `numbers` from {low} to {high}, both included, in their order.",
        f"return [x for x in numbers if {low} <= x <= {high}]",
        f"return [x for x in numbers if {low} < x < {high}]",
        _cases(lambda numbers: [x for x in numbers if low <= x <= high], inputs),
    )


def count_from_set(rng: random.Random) -> Spec:
    letters = "".join(sorted(rng.sample("abcdefgh", rng.randint(2, 4))))
    inputs = [(letters[0] * 2,), *((_word(rng, "abcdefgh"),) for _ in range(4))]
    return Spec(
        "text",
        f"returns how many characters of `text` are among the letters {letters!r}.",
        f"return sum(1 for c in text if c in {letters!r})",
        f"return len(set(text) & set({letters!r}))",
        _cases(lambda text: sum(1 for c in text if c in letters), inputs),
    )


def digit_sum_times(rng: random.Random) -> Spec:
    k = rng.randint(2, 20)
    inputs = [(23,), *((rng.randint(0, 9999),) for _ in range(4))]
    return Spec(
        "n",
        f"returns the sum of the digits of the non-negative integer `n`, multiplied by {k}.",
        f"return sum(int(d) for d in str(n)) * {k}",
        f"return sum(int(d) for d in str(n)) + {k}",
        _cases(lambda n: sum(int(d) for d in str(n)) * k, inputs),
    )


def reverse_words(rng: random.Random) -> Spec:
    separator = rng.choice((" ", "-", ", ", "_", "/", " | ", "+", ";", ":", "."))
    inputs = [("ab cd",), *((_sentence(rng),) for _ in range(4))]
    return Spec(
        "sentence",
        f"returns the words of `sentence` (separated by spaces) in reverse order, joined by {separator!r}.",
        f"return {separator!r}.join(reversed(sentence.split()))",
        f"return {separator!r}.join(sentence.split())",
        _cases(lambda sentence: separator.join(reversed(sentence.split())), inputs),
    )


def count_multiples(rng: random.Random) -> Spec:
    k = rng.randint(2, 20)
    inputs = [(2 * k,), *((rng.randint(0, 100),) for _ in range(4))]
    return Spec(
        "n",
        f"returns how many of the integers from 1 to `n` are divisible by {k}.",
        f"return n // {k}",
        f"return (n - 1) // {k}",
        _cases(lambda n: n // k, inputs),
    )


def weighted_sums(rng: random.Random) -> Spec:
    k, m = rng.sample(range(2, 7), 2)
    pairs: list[tuple[object, ...]] = [([1], [2])]
    for _ in range(4):
        a = _numbers(rng)
        pairs.append((a, _numbers(rng, size=(len(a), len(a)))))
    return Spec(
        "a, b",
        f"returns the list whose element i is {k} * a[i] + {m} * b[i], for lists `a` and `b` of equal length.",
        f"return [{k} * x + {m} * y for x, y in zip(a, b)]",
        f"return [{m} * x + {k} * y for x, y in zip(a, b)]",
        _cases(lambda a, b: [k * x + m * y for x, y in zip(a, b)], pairs),
    )


CodeTemplate = Callable[[random.Random], Spec]
TEMPLATE_SPLITS: dict[str, tuple[CodeTemplate, ...]] = {
    "train": (
        add_to_each, count_above, join_repeated, sum_divisible, clamp,
        last_chars, scale_each, count_letter, first_index_above, every_kth,
        number_query, word_query, text_transform,
    ),
    "validation": (replace_letter, count_long_words, running_total, pad_left, product_below),
    "test": (keep_between, count_from_set, digit_sum_times, reverse_words, count_multiples, weighted_sums),
}  # fmt: skip


def write_check(cases: Sequence[Case]) -> str:
    """`def check(candidate):` with one assert per case."""
    lines = [f"    assert candidate({', '.join(map(repr, arguments))}) == {result!r}" for arguments, result in cases]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def code_problem(template: CodeTemplate, split: str, rng: random.Random) -> CodeProblem:
    spec = template(rng)
    name = spec.name or template.__name__
    header = f"def {name}({spec.arguments}):\n    "
    return CodeProblem(
        template.__name__,
        split,
        name,
        spec.arguments,
        spec.description,
        header + spec.body,
        header + spec.wrong,
        write_check(spec.cases),
    )


def code_split(split: str, count: int, seed: int = 0) -> list[CodeProblem]:
    """`count` problems with distinct prompts from the templates of `split`, taken in turn."""
    check_split(split)
    check_count(count)
    rng = random.Random(f"code/{split}/{seed}")
    templates = TEMPLATE_SPLITS[split]
    return distinct_draws(templates, count, lambda template: code_problem(template, split, rng), lambda p: p.prompt)
