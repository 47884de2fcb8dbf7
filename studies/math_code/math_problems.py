"""Grade-school word problems with worked solutions that end in the answer line "The answer is N."

Each template is one story with several steps; together they use all four operations, units
(km, liters, grams, dollars, minutes, mm, ...) and names. The templates fall into three disjoint sets
(`TEMPLATE_SPLITS`): train, validation (for choosing merges) and test, so that a held-out score
measures the arithmetic in words, not a memorised story.

Ranges, small enough for a 135M model: factors, divisors and addends are integers in 1..60, and every
number in a question, every intermediate result and every answer is an integer in 0..999 (most below
300); a division always comes out exact, nothing is negative. The
numbers appear in the question in the order the template's docstring lists them (the tests recompute
each answer from them). Problems are deterministic in `(split, count, seed)`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from mergecompose.studies.math_code.splits import check_count, check_split, distinct_draws

ANSWER_LINE = "The answer is {answer}."
MATH_INSTRUCTION = 'Solve it step by step and end with the line "The answer is N."'
NAMES = (
    "Maya", "Leo", "Ana", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aisha", "Ben",
    "Mei", "Carlos", "Nora", "Ivan", "Zoe", "Kofi",
)  # fmt: skip


@dataclass(frozen=True)
class MathProblem:
    """One word problem: `question`, its worked `solution` (ending in the answer line) and the `answer`."""

    template: str
    split: str
    question: str
    solution: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.question}\n{MATH_INSTRUCTION}"


Story = tuple[str, list[str], int]  # (question, worked steps, answer)


def _solution(steps: list[str], answer: int) -> str:
    return "\n".join([*steps, ANSWER_LINE.format(answer=answer)])


# Train templates.


def apples(rng: random.Random, name: str) -> Story:
    """a + b * c - d: fruit bought in bags, some eaten."""
    fruit = rng.choice(("apples", "oranges", "pears", "plums"))
    a, b, c = rng.randint(2, 20), rng.randint(2, 6), rng.randint(2, 9)
    d = rng.randint(1, a + b * c - 1)
    bags, total = b * c, a + b * c
    question = (
        f"{name} has {a} {fruit}. {name} buys {b} bags with {c} {fruit} in each bag and then eats {d} {fruit}. "
        f"How many {fruit} does {name} have now?"
    )
    steps = [
        f"The bags hold {b} * {c} = {bags} {fruit}.",
        f"With the {a} {fruit} from before, {name} has {a} + {bags} = {total} {fruit}.",
        f"After eating {d}, {total} - {d} = {total - d} {fruit} are left.",
    ]
    return question, steps, total - d


def cookies(rng: random.Random, name: str) -> Story:
    """a * b / c: trays of cookies shared equally (b = c * k)."""
    a, c, k = rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 5)
    b = c * k
    question = (
        f"{name} bakes {a} trays with {b} cookies on each tray and shares all the cookies equally among "
        f"{c} friends. How many cookies does each friend get?"
    )
    steps = [f"There are {a} * {b} = {a * b} cookies.", f"Each friend gets {a * b} / {c} = {a * k} cookies."]
    return question, steps, a * k


def train_trip(rng: random.Random, name: str) -> Story:
    """a * b + c * d: two legs of a trip at two speeds."""
    a, b, c, d = rng.randint(10, 60), rng.randint(2, 5), rng.randint(10, 60), rng.randint(2, 5)
    vehicle = rng.choice(("train", "bus", "car"))
    question = (
        f"A {vehicle} travels at {a} km per hour for {b} hours and then at {c} km per hour for {d} hours. "
        f"How many km does the {vehicle} travel in total?"
    )
    steps = [
        f"The first part is {a} * {b} = {a * b} km.",
        f"The second part is {c} * {d} = {c * d} km.",
        f"In total {a * b} + {c * d} = {a * b + c * d} km.",
    ]
    return question, steps, a * b + c * d


def notebooks(rng: random.Random, name: str) -> Story:
    """a - b * c: money left after buying several things at one price."""
    item = rng.choice(("notebooks", "pens", "books", "tickets"))
    b, c = rng.randint(2, 8), rng.randint(2, 12)
    a = b * c + rng.randint(0, 30)
    question = f"{name} has {a} dollars and buys {b} {item} at {c} dollars each. How many dollars are left?"
    steps = [f"The {item} cost {b} * {c} = {b * c} dollars.", f"{name} has {a} - {b * c} = {a - b * c} dollars left."]
    return question, steps, a - b * c


def reading(rng: random.Random, name: str) -> Story:
    """d - (a * b + c): pages left in a book."""
    a, b, c = rng.randint(5, 30), rng.randint(2, 7), rng.randint(1, 20)
    d = a * b + c + rng.randint(1, 60)
    read = a * b + c
    question = (
        f"{name} reads {a} pages a day for {b} days and then {c} more pages. The book has {d} pages. "
        "How many pages are left to read?"
    )
    steps = [
        f"In {b} days {name} reads {a} * {b} = {a * b} pages.",
        f"With {c} more pages that is {a * b} + {c} = {read} pages.",
        f"The pages left are {d} - {read} = {d - read}.",
    ]
    return question, steps, d - read


def pencil_boxes(rng: random.Random, name: str) -> Story:
    """a / b - c: items packed into boxes, some boxes sold (a = b * m)."""
    b, m = rng.randint(2, 12), rng.randint(3, 20)
    a, c = b * m, rng.randint(1, m - 1)
    question = f"A shop packs {a} pencils into boxes of {b} pencils and sells {c} boxes. How many boxes are left?"
    steps = [f"The shop has {a} / {b} = {m} boxes.", f"After selling {c}, {m} - {c} = {m - c} boxes are left."]
    return question, steps, m - c


def ages(rng: random.Random, name: str) -> Story:
    """a * b + c: a parent's age in some years."""
    a, b, c = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 20)
    parent = rng.choice(("mother", "father", "aunt", "uncle"))
    question = (
        f"{name} is {a} years old, and {name}'s {parent} is {b} times as old. "
        f"How old will the {parent} be in {c} years?"
    )
    steps = [f"The {parent} is {a} * {b} = {a * b} years old.", f"In {c} years: {a * b} + {c} = {a * b + c} years."]
    return question, steps, a * b + c


def garden(rng: random.Random, name: str) -> Story:
    """a * b - c + d: rows of plants, some die, some planted."""
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    c, d = rng.randint(1, a * b), rng.randint(1, 30)
    plant = rng.choice(("tomato plants", "tulips", "trees", "bushes"))
    question = (
        f"A garden has {a} rows of {b} {plant}. {c} of them die, and {name} plants {d} new ones. "
        f"How many {plant} are in the garden now?"
    )
    steps = [
        f"At first there are {a} * {b} = {a * b} {plant}.",
        f"After {c} die, {a * b} - {c} = {a * b - c} are left.",
        f"With {d} new ones: {a * b - c} + {d} = {a * b - c + d} {plant}.",
    ]
    return question, steps, a * b - c + d


def savings_jars(rng: random.Random, name: str) -> Story:
    """a * b / c: weekly savings split equally into jars (a = c * k)."""
    c, k, b = rng.randint(2, 5), rng.randint(1, 6), rng.randint(2, 10)
    a = c * k
    question = (
        f"{name} saves {a} dollars every week. After {b} weeks {name} splits the savings equally into {c} jars. "
        "How many dollars go into each jar?"
    )
    steps = [f"{name} saves {a} * {b} = {a * b} dollars.", f"Each jar gets {a * b} / {c} = {k * b} dollars."]
    return question, steps, k * b


def water_tank(rng: random.Random, name: str) -> Story:
    """a - b * c + d: bottles filled from a tank, then water added."""
    b, c, d = rng.randint(2, 8), rng.randint(2, 5), rng.randint(1, 40)
    a = b * c + rng.randint(5, 60)
    question = (
        f"A tank holds {a} liters of water. {name} fills {b} bottles of {c} liters each from the tank and "
        f"then adds {d} liters. How many liters are in the tank now?"
    )
    steps = [
        f"The bottles take {b} * {c} = {b * c} liters.",
        f"The tank then holds {a} - {b * c} = {a - b * c} liters.",
        f"After adding {d}: {a - b * c} + {d} = {a - b * c + d} liters.",
    ]
    return question, steps, a - b * c + d


def piano(rng: random.Random, name: str) -> Story:
    """a * b + 2 * a * c: practice on weekdays, twice as long on weekend days."""
    a, b, c = rng.randint(5, 30), rng.randint(2, 5), rng.randint(1, 2)
    weekend = 2 * a
    question = (
        f"{name} practises the piano for {a} minutes on each of {b} weekdays and for twice as long on each of "
        f"{c} weekend days. How many minutes does {name} practise in total?"
    )
    steps = [
        f"On weekdays: {a} * {b} = {a * b} minutes.",
        f"A weekend day is {a} * 2 = {weekend} minutes, so {weekend} * {c} = {weekend * c} minutes.",
        f"In total {a * b} + {weekend * c} = {a * b + weekend * c} minutes.",
    ]
    return question, steps, a * b + weekend * c


def marbles(rng: random.Random, name: str) -> Story:
    """a - b * c + d: marbles given to friends, then more found."""
    b, c, d = rng.randint(2, 6), rng.randint(2, 6), rng.randint(1, 20)
    a = b * c + rng.randint(0, 30)
    question = (
        f"{name} has {a} marbles, gives {b} marbles to each of {c} friends and then finds {d} more. "
        f"How many marbles does {name} have now?"
    )
    steps = [
        f"{name} gives away {b} * {c} = {b * c} marbles.",
        f"That leaves {a} - {b * c} = {a - b * c} marbles.",
        f"After finding {d}: {a - b * c} + {d} = {a - b * c + d} marbles.",
    ]
    return question, steps, a - b * c + d


# Procedural train stories: each draws a story of 2-4 steps from pools of settings and phrases, so the
# train split holds far more than a handful of story shapes (the fixed templates above are 12). Only the
# train split has them; the numbers keep the module's ranges.

THINGS = (
    "stickers", "marbles", "stamps", "shells", "coins", "cards", "beads", "buttons", "balloons", "books",
    "candles", "eggs", "cupcakes", "bottles", "ribbons", "toy cars", "pebbles", "postcards", "pencils", "seeds",
)  # fmt: skip
CONTAINERS = ("bags", "boxes", "packs", "jars", "crates", "baskets", "tins", "cartons")
GAINS = ("buys", "finds", "gets", "collects", "is given", "wins")
LOSSES = ("gives away", "loses", "sells", "uses", "donates")
FRIENDS = ("friends", "classmates", "cousins", "neighbours", "teammates")


def _divisor(rng: random.Random, total: int) -> int | None:
    """A divisor of `total` in 2..9 (so the share comes out exact), or None if it has none."""
    divisors = [k for k in range(2, 10) if total % k == 0]
    return rng.choice(divisors) if divisors else None


def collection(rng: random.Random, name: str) -> Story:
    """a, then 2-3 changes (+ n, - n, + b * c, - b * c, * k, / 2), maybe shared equally at the end."""
    thing = rng.choice(THINGS)
    total = rng.randint(5, 60)
    sentences = [rng.choice((f"{name} has {total} {thing}.", f"{name} starts with {total} {thing}."))]
    steps: list[str] = []
    changes = rng.randint(2, 3)
    while len(sentences) <= changes:  # a move that does not fit the running total is drawn again
        move = rng.choice(("gain", "loss", "gain_groups", "loss_groups", "times", "half"))
        if move == "gain":
            n = rng.randint(1, 60)
            sentences.append(f"Then {name} {rng.choice(GAINS)} {n} more {thing}.")
            steps.append(f"After getting {n} more: {total} + {n} = {total + n} {thing}.")
            total += n
        elif move == "loss" and total > 1:
            n = rng.randint(1, total - 1)
            sentences.append(f"Then {name} {rng.choice(LOSSES)} {n} {thing}.")
            steps.append(f"After that {total} - {n} = {total - n} {thing} are left.")
            total -= n
        elif move == "gain_groups":
            b, c = rng.randint(2, 9), rng.randint(2, 12)
            container = rng.choice(CONTAINERS)
            sentences.append(f"{name} {rng.choice(GAINS)} {b} {container} with {c} {thing} in each.")
            steps += [
                f"The {container} hold {b} * {c} = {b * c} {thing}.",
                f"{total} + {b * c} = {total + b * c} {thing}.",
            ]
            total += b * c
        elif move == "loss_groups" and total >= 4:
            c = rng.randint(1, max(1, total // 4))
            b = rng.randint(2, max(2, min(6, total // c)))
            if b * c < total:
                sentences.append(f"{name} {rng.choice(LOSSES)} {b} groups of {c} {thing}.")
                steps += [
                    f"That is {b} * {c} = {b * c} {thing}.",
                    f"{total} - {b * c} = {total - b * c} {thing} are left.",
                ]
                total -= b * c
        elif move == "times" and total <= 300:
            k = rng.randint(2, min(5, 999 // total))
            sentences.append(f"Then the number of {thing} becomes {k} times as large.")
            steps.append(f"{k} times as many: {total} * {k} = {total * k} {thing}.")
            total *= k
        elif move == "half" and total % 2 == 0:
            sentences.append(f"{name} gives half of the {thing} to a sister.")
            steps.append(f"Half of them is {total} / 2 = {total // 2}, so {total // 2} {thing} are left.")
            total //= 2
    k = _divisor(rng, total) if rng.random() < 0.4 else None
    if k is not None:
        friends = rng.choice(FRIENDS)
        sentences.append(f"{name} shares all the {thing} equally among {k} {friends}. How many {thing} does each get?")
        steps.append(f"Each of the {k} {friends} gets {total} / {k} = {total // k} {thing}.")
        total //= k
    else:
        sentences.append(rng.choice((f"How many {thing} does {name} have now?", f"How many {thing} are there now?")))
    return " ".join(sentences), steps, total


RATES = (  # (what runs at a rate, the rate's unit per time unit, the total's unit, the time unit)
    ("A cyclist rides {r} km an hour", "km", "hours"),
    ("A tap pours {r} liters a minute", "liters", "minutes"),
    ("{name} earns {r} dollars an hour", "dollars", "hours"),
    ("A printer prints {r} pages a minute", "pages", "minutes"),
    ("A machine makes {r} toys an hour", "toys", "hours"),
    ("{name} walks {r} km a day", "km", "days"),
    ("A bakery sells {r} loaves a day", "loaves", "days"),
    ("{name} reads {r} pages an hour", "pages", "hours"),
)


def rates(rng: random.Random, name: str) -> Story:
    """r * t, then a second stretch (+ r2 * t2) or a part taken off (- n), maybe split equally (/ k)."""
    pattern, unit, time_unit = rng.choice(RATES)
    r, t = rng.randint(2, 40), rng.randint(2, 9)
    sentences = [f"{pattern.format(r=r, name=name)} for {t} {time_unit}."]
    steps = [f"That makes {r} * {t} = {r * t} {unit}."]
    total = r * t
    if rng.random() < 0.5:
        r2, t2 = rng.randint(2, 40), rng.randint(2, 6)
        sentences.append(f"Then the rate changes to {r2} {unit} for {t2} more {time_unit}.")
        steps += [
            f"The second part is {r2} * {t2} = {r2 * t2} {unit}.",
            f"In all {total} + {r2 * t2} = {total + r2 * t2} {unit}.",
        ]
        total += r2 * t2
    elif total > 2:
        n = rng.randint(1, total - 1)
        sentences.append(f"Of these, {n} {unit} are not counted.")
        steps.append(f"Without them: {total} - {n} = {total - n} {unit}.")
        total -= n
    k = _divisor(rng, total) if rng.random() < 0.4 else None
    if k is not None:
        sentences.append(f"The {unit} are split equally into {k} parts. How many {unit} are in each part?")
        steps.append(f"Each part has {total} / {k} = {total // k} {unit}.")
        total //= k
    else:
        sentences.append(f"How many {unit} is that in total?")
    return " ".join(sentences), steps, total


GOODS = ("apples", "notebooks", "pens", "cups", "plates", "towels", "socks", "candles", "bowls", "kites")


def shopping(rng: random.Random, name: str) -> Story:
    """q1 * p1 (+ q2 * p2), paid from what one has (money - cost) or asked for (the cost)."""
    first, second = rng.sample(GOODS, 2)
    q1, p1 = rng.randint(2, 9), rng.randint(2, 25)
    sentences = [f"{name} buys {q1} {first} at {p1} dollars each"]
    steps = [f"The {first} cost {q1} * {p1} = {q1 * p1} dollars."]
    cost = q1 * p1
    if rng.random() < 0.6:
        q2, p2 = rng.randint(2, 9), rng.randint(2, 25)
        sentences[0] += f" and {q2} {second} at {p2} dollars each."
        steps += [
            f"The {second} cost {q2} * {p2} = {q2 * p2} dollars.",
            f"Together {cost} + {q2 * p2} = {cost + q2 * p2} dollars.",
        ]
        cost += q2 * p2
    else:
        sentences[0] += "."
    if len(steps) == 1 or rng.random() < 0.6:  # at least two steps
        money = cost + rng.randint(0, 100)
        sentences.insert(0, f"{name} has {money} dollars.")
        sentences.append("How many dollars are left?")
        steps.append(f"{name} has {money} - {cost} = {money - cost} dollars left.")
        return " ".join(sentences), steps, money - cost
    sentences.append("How many dollars does that cost in all?")
    return " ".join(sentences), steps, cost


def comparison(rng: random.Random, name: str) -> Story:
    """a, k times a, then n more or fewer: one of them, or the three together."""
    thing = rng.choice(THINGS)
    other, third = rng.sample([n for n in NAMES if n != name], 2)
    a, k = rng.randint(2, 40), rng.randint(2, 5)
    b = a * k
    n = rng.randint(1, b - 1)
    more = rng.random() < 0.5
    c = b + n if more else b - n
    sentences = [
        f"{name} has {a} {thing}.",
        f"{other} has {k} times as many {thing} as {name}.",
        f"{third} has {n} {'more' if more else 'fewer'} {thing} than {other}.",
    ]
    steps = [f"{other} has {a} * {k} = {b} {thing}.", f"{third} has {b} {'+' if more else '-'} {n} = {c} {thing}."]
    if rng.random() < 0.5:
        sentences.append(f"How many {thing} do the three have together?")
        steps.append(f"Together {a} + {b} + {c} = {a + b + c} {thing}.")
        return " ".join(sentences), steps, a + b + c
    sentences.append(f"How many {thing} does {third} have?")
    return " ".join(sentences), steps, c


# The standard types of one-step word problems, chained (`problem_types`): an optional train template
# (`math_split(..., types_weight=w)`), not part of the default train split.

PLACES = ("shelf", "box", "album", "jar", "cupboard", "drawer", "basket", "case")
KEEPERS = ("a teacher", "the club", "the library", "a neighbour", "the school")
PARTS = ((2, "half"), (3, "a third"), (4, "a quarter"))


def problem_types(rng: random.Random, name: str) -> Story:
    """A story of `_one_type_story` with at least two steps."""
    while True:
        question, steps, answer = _one_type_story(rng, name)
        if len(steps) >= 2:
            return question, steps, answer


def _one_type_story(rng: random.Random, name: str) -> Story:
    """A start (given, equal groups, or two amounts joined), maybe a change (join, separate, a fraction given
    away), then a question of one of the standard types: the result, a missing part to a target, measurement
    division (how many groups of k), partitive division (equal shares), or a difference with another amount.
    A number the question needs is stated first or last in the story, at random."""
    thing = rng.choice(THINGS)
    other = rng.choice([n for n in NAMES if n != name])
    start = rng.choice(("given", "groups", "join"))
    if start == "given":
        total = rng.randint(6, 90)
        sentences, steps = [f"{name} has {total} {thing}."], []
    elif start == "groups":
        b, c = rng.randint(2, 9), rng.randint(2, 15)
        container = rng.choice(CONTAINERS)
        sentences = [
            rng.choice(
                (
                    f"{name} has {b} {container} with {c} {thing} in each.",
                    f"Each of {name}'s {b} {container} holds {c} {thing}.",
                    f"{name} fills {b} {container}, putting {c} {thing} in every one.",
                )
            )
        ]
        steps, total = [f"There are {b} * {c} = {b * c} {thing}."], b * c
    else:
        a, b = rng.randint(3, 60), rng.randint(3, 60)
        sentences = [f"{name} has {a} {thing} and {other} gives {name} {b} more."]
        steps, total = [f"{name} has {a} + {b} = {a + b} {thing}."], a + b
    if rng.random() < 0.5:  # a change
        change = rng.choice(("join", "separate", "part"))
        if change == "join":
            n = rng.randint(1, 40)
            sentences.append(f"Later {name} {rng.choice(GAINS)} {n} more.")
            steps.append(f"With {n} more: {total} + {n} = {total + n} {thing}.")
            total += n
        elif change == "separate" and total > 2:
            n = rng.randint(1, total - 2)
            sentences.append(f"{name} {rng.choice(LOSSES)} {n} of them.")
            steps.append(f"After that {total} - {n} = {total - n} {thing} are left.")
            total -= n
        else:
            fitting = [(k, word) for k, word in PARTS if total % k == 0]
            if fitting:
                k, word = rng.choice(fitting)
                sentences.append(f"{name} gives {word} of them to {rng.choice(KEEPERS)}.")
                steps += [
                    f"{word.capitalize()} of {total} is {total} / {k} = {total // k}.",
                    f"{name} keeps {total} - {total // k} = {total - total // k} {thing}.",
                ]
                total -= total // k
    question = rng.choice(("result", "missing", "measure", "share", "difference"))
    given: str | None = None  # a sentence with a number the question needs, put first or last
    if question == "missing" and total <= 900:
        target = total + rng.randint(1, min(99, 999 - total))
        place = rng.choice(PLACES)
        given, ask = rng.choice(
            (
                (f"{name} wants {target} {thing} in all.", f"How many more {thing} does {name} need?"),
                (f"The {place} has room for {target} {thing}.", f"How many more {thing} fit in?"),
            )
        )
        steps.append(f"Still missing: {target} - {total} = {target - total} {thing}.")
        total = target - total
    elif question == "measure" and (k := _divisor(rng, total)) is not None:
        container = rng.choice(CONTAINERS)
        given = f"{name} packs the {thing} into {container} of {k}."
        ask = f"How many {container} does {name} fill?"
        steps.append(f"{total} / {k} = {total // k} {container}.")
        total //= k
    elif question == "share" and (k := _divisor(rng, total)) is not None:
        friends = rng.choice(FRIENDS)
        given = f"{name} shares all the {thing} equally among {k} {friends}."
        ask = f"How many {thing} does each of the {friends} get?"
        steps.append(f"Each gets {total} / {k} = {total // k} {thing}.")
        total //= k
    elif question == "difference" and total >= 3:
        m = rng.randint(1, total - 1)
        given = f"{other} has {m} {thing}."
        ask = f"How many more {thing} does {name} have than {other}?"
        steps.append(f"The difference is {total} - {m} = {total - m} {thing}.")
        total -= m
    else:
        ask = rng.choice((f"How many {thing} does {name} have now?", f"How many {thing} are there now?"))
    if given is not None:
        sentences = [given, *sentences] if rng.random() < 0.5 else [*sentences, given]
    return " ".join([*sentences, ask]), steps, total


# Validation templates.


def tickets(rng: random.Random, name: str) -> Story:
    """a * c + b * d: adult and child tickets."""
    a, b, c, d = rng.randint(5, 20), rng.randint(2, 10), rng.randint(1, 6), rng.randint(1, 8)
    place = rng.choice(("museum", "zoo", "cinema", "concert"))
    question = (
        f"Tickets for the {place} cost {a} dollars for an adult and {b} dollars for a child. A group of {c} adults "
        f"and {d} children buys tickets. How many dollars does the group pay?"
    )
    steps = [
        f"The adults pay {a} * {c} = {a * c} dollars.",
        f"The children pay {b} * {d} = {b * d} dollars.",
        f"Together {a * c} + {b * d} = {a * c + b * d} dollars.",
    ]
    return question, steps, a * c + b * d


def cake_slices(rng: random.Random, name: str) -> Story:
    """(a * b - c) / d: slices left after a party, shared (the rest is d * k)."""
    a, b, d, k = rng.randint(2, 5), rng.randint(6, 12), rng.randint(2, 5), rng.randint(1, 4)
    c = a * b - d * k
    if c < 1:
        a, c = a + 2, (a + 2) * b - d * k
    rest = a * b - c
    question = (
        f"{name} cuts {a} cakes into {b} slices each. The guests eat {c} slices, and the rest is shared equally "
        f"by {d} people. How many slices does each person get?"
    )
    steps = [
        f"There are {a} * {b} = {a * b} slices.",
        f"After the guests, {a * b} - {c} = {rest} slices are left.",
        f"Each person gets {rest} / {d} = {rest // d} slices.",
    ]
    return question, steps, rest // d


def fuel(rng: random.Random, name: str) -> Story:
    """a * b * c * d: fuel for trips over weeks, and its price."""
    a, b, c, d = rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 4), rng.randint(2, 3)
    trips = b * c
    question = (
        f"{name}'s car uses {a} liters of fuel on each trip. {name} makes {b} trips a week for {c} weeks, and fuel "
        f"costs {d} dollars a liter. How many dollars does the fuel cost?"
    )
    steps = [
        f"{name} makes {b} * {c} = {trips} trips.",
        f"They use {a} * {trips} = {a * trips} liters.",
        f"The fuel costs {a * trips} * {d} = {a * trips * d} dollars.",
    ]
    return question, steps, a * trips * d


def school_teams(rng: random.Random, name: str) -> Story:
    """(a * b - c) / d: students left after some leave, in teams (the rest is d * k)."""
    a, b, d, k = rng.randint(2, 6), rng.randint(10, 25), rng.randint(2, 6), rng.randint(2, 10)
    c = a * b - d * k
    while c < 1:
        a += 1
        c = a * b - d * k
    rest = a * b - c
    question = (
        f"A school has {a} classes with {b} students each. {c} students go home, and the others form teams of "
        f"{d}. How many teams are there?"
    )
    steps = [
        f"There are {a} * {b} = {a * b} students.",
        f"After {c} go home, {a * b} - {c} = {rest} students stay.",
        f"They make {rest} / {d} = {rest // d} teams.",
    ]
    return question, steps, rest // d


def stamps(rng: random.Random, name: str) -> Story:
    """a + (a + b) + c * a: three collections compared with one."""
    a, b, c = rng.randint(3, 30), rng.randint(1, 20), rng.randint(2, 4)
    question = (
        f"{name} has {a} stamps. {name}'s brother has {b} more stamps than {name}, and {name}'s sister has {c} "
        f"times as many as {name}. How many stamps do the three have together?"
    )
    steps = [
        f"The brother has {a} + {b} = {a + b} stamps.",
        f"The sister has {c} * {a} = {c * a} stamps.",
        f"Together {a} + {a + b} + {c * a} = {a + a + b + c * a} stamps.",
    ]
    return question, steps, a + a + b + c * a


def muffins(rng: random.Random, name: str) -> Story:
    """a / b * c: flour scaled from one batch to another (a = b * k)."""
    b, k, c = rng.randint(2, 12), rng.randint(5, 20), rng.randint(2, 20)
    a = b * k
    question = (
        f"A recipe needs {a} grams of flour for {b} muffins. {name} wants to bake {c} muffins. "
        "How many grams of flour does that need?"
    )
    steps = [f"One muffin needs {a} / {b} = {k} grams.", f"{c} muffins need {k} * {c} = {k * c} grams."]
    return question, steps, k * c


# Test templates.


def farm_legs(rng: random.Random, name: str) -> Story:
    """2 * a + 4 * b: legs of chickens and cows."""
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    question = f"{name}'s farm has {a} chickens and {b} cows. How many legs do the animals have in all?"
    steps = [
        f"A chicken has 2 legs, so the chickens have {a} * 2 = {2 * a} legs.",
        f"A cow has 4 legs, so the cows have {b} * 4 = {4 * b} legs.",
        f"In all {2 * a} + {4 * b} = {2 * a + 4 * b} legs.",
    ]
    return question, steps, 2 * a + 4 * b


def profit(rng: random.Random, name: str) -> Story:
    """a * (c - b): pens bought at one price and sold at a higher one."""
    a, b = rng.randint(2, 30), rng.randint(1, 10)
    c = b + rng.randint(1, 8)
    item = rng.choice(("pens", "cups", "kites", "hats"))
    question = (
        f"{name} buys {a} {item} for {b} dollars each and sells each one for {c} dollars. "
        f"How many dollars of profit does {name} make?"
    )
    steps = [
        f"{name} pays {a} * {b} = {a * b} dollars.",
        f"{name} receives {a} * {c} = {a * c} dollars.",
        f"The profit is {a * c} - {a * b} = {a * c - a * b} dollars.",
    ]
    return question, steps, a * c - a * b


def empty_seats(rng: random.Random, name: str) -> Story:
    """a * b - c - d: seats left after two stops."""
    a, b = rng.randint(2, 10), rng.randint(10, 40)
    c = rng.randint(1, a * b // 2)
    d = rng.randint(1, a * b - c)
    question = (
        f"A train has {a} cars with {b} seats each. At the first stop {c} people get on, and at the second stop "
        f"{d} more get on. How many seats are still empty?"
    )
    steps = [
        f"The train has {a} * {b} = {a * b} seats.",
        f"After the first stop {a * b} - {c} = {a * b - c} seats are empty.",
        f"After the second stop {a * b - c} - {d} = {a * b - c - d} seats are empty.",
    ]
    return question, steps, a * b - c - d


def pizza_bill(rng: random.Random, name: str) -> Story:
    """b * c / a: a bill split equally among friends (c = a * k)."""
    a, k, b = rng.randint(2, 6), rng.randint(2, 4), rng.randint(2, 8)
    c = a * k
    question = (
        f"{name} and friends, {a} people in all, eat {b} pizzas that cost {c} dollars each and split the bill "
        "equally. How many dollars does each person pay?"
    )
    steps = [f"The bill is {b} * {c} = {b * c} dollars.", f"Each person pays {b * c} / {a} = {b * k} dollars."]
    return question, steps, b * k


def crayons(rng: random.Random, name: str) -> Story:
    """(a * b - c) / 2: half of what is left is given away (a * b - c is even)."""
    a, b = rng.randint(2, 8), rng.randint(4, 12)
    c = rng.randint(1, a * b - 2)
    if (a * b - c) % 2:
        c += 1
    rest = a * b - c
    question = (
        f"{name} has {a} boxes of {b} crayons, loses {c} crayons and gives half of the rest to a friend. "
        f"How many crayons does {name} keep?"
    )
    steps = [
        f"{name} has {a} * {b} = {a * b} crayons.",
        f"After losing {c}, {a * b} - {c} = {rest} are left.",
        f"Half of them is {rest} / 2 = {rest // 2} crayons.",
    ]
    return question, steps, rest // 2


def pool(rng: random.Random, name: str) -> Story:
    """(a - b * c) / b: minutes until a pool is full (a = b * (c + r))."""
    b, c, r = rng.randint(2, 12), rng.randint(2, 30), rng.randint(1, 30)
    a = b * (c + r)
    question = (
        f"A pool holds {a} liters. A pump fills it with {b} liters per minute and has run for {c} minutes. "
        "How many more minutes until the pool is full?"
    )
    steps = [
        f"So far the pump has filled {b} * {c} = {b * c} liters.",
        f"Still missing: {a} - {b * c} = {a - b * c} liters.",
        f"That takes {a - b * c} / {b} = {r} more minutes.",
    ]
    return question, steps, r


STEP = re.compile(r"(?<![\d*/+-] )\b(\d+) ([-+*/]) (\d+) = (\d+)\b(?! [-+*/])")  # "a op b = c", not in a longer sum


def expanded_arithmetic(solution: str) -> str:
    """`solution` with each two-number step worked out by place value, the way a small model can follow it.

    "21 * 3 = 63" becomes "21 * 3 = 20 * 3 + 1 * 3 = 60 + 3 = 63"; "47 + 35 = 82" becomes
    "47 + 35 = 47 + 30 + 5 = 77 + 5 = 82"; "82 - 35 = 47" becomes "82 - 35 = 82 - 30 - 5 = 52 - 5 = 47".
    A step with a one-digit second number (or first, for products), a division, or a longer sum is kept.
    """

    def expand(match: re.Match[str]) -> str:
        a, operator, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
        tens, ones = b - b % 10, b % 10
        if operator == "*":
            big, small = (a, b) if a >= b else (b, a)
            if big < 10:
                return match[0]
            tens, ones = big - big % 10, big % 10
            if ones == 0:
                return match[0]
            return f"{a} * {b} = {tens} * {small} + {ones} * {small} = {tens * small} + {ones * small} = {c}"
        if operator in "+-" and b >= 10 and ones:
            middle = a + tens if operator == "+" else a - tens
            return f"{a} {operator} {b} = {a} {operator} {tens} {operator} {ones} = {middle} {operator} {ones} = {c}"
        return match[0]

    return STEP.sub(expand, solution)


Template = Callable[[random.Random, str], Story]
TEMPLATE_SPLITS: dict[str, tuple[Template, ...]] = {
    "train": (
        apples, cookies, train_trip, notebooks, reading, pencil_boxes,
        ages, garden, savings_jars, water_tank, piano, marbles,
        collection, rates, shopping, comparison,
    ),
    "validation": (tickets, cake_slices, fuel, school_teams, stamps, muffins),
    "test": (farm_legs, profit, empty_seats, pizza_bill, crayons, pool),
}  # fmt: skip


PROCEDURAL = (collection, rates, shopping, comparison)  # the train split's procedural templates


def _check_weight(name: str, value: object, default: int, split: str, why: str) -> None:
    """A train-only weight: an integer >= `default`, and `default` itself for a held-out split."""
    if isinstance(value, bool) or not isinstance(value, int) or value < default:
        raise ValueError(f"`{name}` must be an integer >= {default}, got {value!r}")
    if value != default and split != "train":
        raise ValueError(f"`{name}` must be {default} for the {split} split ({why})")


def math_split(
    split: str, count: int, seed: int = 0, procedural_weight: int = 1, types_weight: int = 0
) -> list[MathProblem]:
    """`count` problems with distinct questions from the templates of `split`, taken in turn.

    `procedural_weight` (train only) takes each procedural template (`PROCEDURAL`) that many times a turn,
    so they make 4w / (12 + 4w) of the problems instead of 4 / 16: 1 keeps every template's share equal.
    `types_weight` (train only) adds `problem_types` to the train templates, that many times a turn (0: not at all).
    """
    check_split(split)
    check_count(count)
    _check_weight("procedural_weight", procedural_weight, 1, split, "only train has procedural templates")
    _check_weight("types_weight", types_weight, 0, split, "problem_types is a train template")
    rng = random.Random(f"math/{split}/{seed}")

    def draw(template: Template) -> MathProblem:
        question, steps, answer = template(rng, rng.choice(NAMES))
        return MathProblem(template.__name__, split, question, _solution(steps, answer), answer)

    templates = TEMPLATE_SPLITS[split]
    if procedural_weight > 1:
        fixed = tuple(template for template in templates if template not in PROCEDURAL)
        templates = fixed + PROCEDURAL * procedural_weight
    templates = templates + (problem_types,) * types_weight
    return distinct_draws(templates, count, draw, lambda problem: problem.question)
