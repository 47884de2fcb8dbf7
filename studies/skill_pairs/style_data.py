"""The style skills of the real settings: a change to the whole answer that a program applies and checks.

A **style** decides how the whole answer reads, whatever it says:

* `capitals`: every letter in capitals;
* `opening`: the answer starts with the fixed phrase `In short:`;
* `one_sentence`: the answer is one sentence.

The format skill `signature` (a closing line `— SmolLM`) also rewrites the answer as a whole, so it pairs with the
styles as one of them (`WHOLE_ANSWER_STYLES`). Two experts that each rewrite the whole answer are where a
composition can over-count the shared change, and where merging may win.

A style expert learns the style alone: it is trained on the **base's own answers**, cut to whole sentences
(`whole_sentences`) and rewritten (`restyled`), to general questions (`style_question`) asked with the style's
instruction. Its held-out items ask other questions with other phrasings of the instruction; a held-out item has
no reference answer (the base's own is not known before the base answers), and its score is the style's check
(`skill_scoring.style_found`). Nothing here loads a model.
"""

from __future__ import annotations

import random
import re

STYLE_SKILLS = ("capitals", "opening", "one_sentence")
WHOLE_ANSWER_STYLES = (*STYLE_SKILLS, "signature")
OPENING = "In short:"

STYLE_PHRASINGS = {
    "capitals": {"train": ["Answer in capital letters.", "Write the reply in all caps.", "Use only uppercase letters."],
                 "held_out": ["Reply entirely in capitals.", "Respond using uppercase letters only."]},
    "opening": {"train": [f"Start your reply with '{OPENING}'.", f"Begin with the words '{OPENING}'.",
                          f"Open your answer with '{OPENING}'."],
                "held_out": [f"Your reply should start with '{OPENING}'.", f"Lead with '{OPENING}'."]},
    "one_sentence": {"train": ["Answer in one sentence.", "Keep it to a single sentence.",
                               "Reply with just one sentence."],
                     "held_out": ["Use only one sentence.", "Respond in a single sentence."]},
}  # fmt: skip

THINGS = ["apple", "river", "candle", "garden", "window", "pencil", "tiger", "cloud", "bottle", "forest", "rocket",
          "button", "planet", "castle", "ladder", "mirror", "orange", "pillow", "violin", "bridge", "camera", "desert",
          "island", "kettle", "lemon", "magnet", "needle", "ocean", "rabbit", "saddle"]  # fmt: skip
QUESTION_PHRASINGS = {  # general questions the base answers in its own words; train and held-out disjoint
    "train": ["What is a {a}?", "What can you do with a {a}?", "Why are {a}s useful?",
              "What do a {a} and a {b} have in common?"],
    "held_out": ["Explain what a {a} is.", "Where would you find a {a}?",
                 "How is a {a} different from a {b}?"],
}  # fmt: skip

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def style_question(rng: random.Random, split: str) -> str:
    """A general question from `split`'s phrasings ("train" or "held_out") about one or two things."""
    a, b = rng.sample(THINGS, 2)
    return rng.choice(QUESTION_PHRASINGS[split]).format(a=a, b=b)


def whole_sentences(text: str) -> str:
    """`text` cut after its last complete sentence (a generation stopped at its token budget ends mid-sentence);
    `text` stripped where it has no complete sentence."""
    text = text.strip()
    if text.endswith((".", "!", "?")):
        return text
    ends = [match.start() for match in re.finditer(r"[.!?](?=\s)", text)]
    return text[: ends[-1] + 1] if ends else text


def first_sentence(text: str) -> str:
    """The first sentence of `text` (up to the first `.`, `!` or `?` followed by a space, or a line break)."""
    return SENTENCE_END.split(text.strip(), maxsplit=1)[0]


def restyled(style: str, text: str) -> str:
    """`text` rewritten in `style`."""
    if style == "capitals":
        return text.upper()
    if style == "opening":
        return f"{OPENING} {text}"
    if style == "one_sentence":
        return first_sentence(text)
    raise ValueError(f"`style` must be one of {', '.join(STYLE_SKILLS)}, got {style!r}")
