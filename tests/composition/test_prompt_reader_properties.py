"""Properties of `read_prompts` (`mergecompose generate --prompts`) over arbitrary files: any file gives a list of
non-blank prompts or is refused with one line naming `--prompts`; prompts written in any of the three forms (plain
lines, .jsonl objects, a .json list) read back as written, with or without a byte-order mark."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergecompose.composition.generate_command import read_prompts

SUFFIXES = (".txt", ".jsonl", ".json")
# What a user's prompts file may hold: text near the three forms (JSON values, lines of them, blank lines, a BOM)
# and arbitrary bytes.
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["prompt", "text", ""]), inner, max_size=2)
    ),
)
LINES = st.lists(JSON_VALUES.map(json.dumps) | st.sampled_from(["", "   ", "\t", "{", "]"]) | st.text(max_size=10))
FILE_TEXTS = (
    JSON_VALUES.map(json.dumps)
    | LINES.map("\n".join)
    | st.builds(lambda bom, text: bom + text, st.sampled_from(["", "\ufeff"]), LINES.map("\n".join))
)
FILE_BYTES = FILE_TEXTS.map(lambda text: text.encode("utf-8", "surrogatepass")) | st.binary(max_size=40)
# Prompts a plain-text file can hold one per line: no line break of any kind, not blank.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
ONE_LINE_PROMPTS = st.text(st.characters(blacklist_characters=LINE_BREAKS, blacklist_categories=["Cs"]), min_size=1)
ONE_LINE_PROMPTS = ONE_LINE_PROMPTS.filter(lambda text: text.strip() and not text.startswith("\ufeff"))
PROMPTS = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1).filter(str.strip)


def _read(data: bytes, suffix: str) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, f"prompts{suffix}")
        path.write_bytes(data)
        return read_prompts(None, str(path))


@settings(max_examples=300, deadline=None)
@given(FILE_BYTES, st.sampled_from(SUFFIXES))
def test_any_file_gives_non_blank_prompts_or_one_line_naming_the_flag(data, suffix):
    try:
        prompts = _read(data, suffix)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and "`--prompts`" in message and len(message) < 400, message
        return
    assert prompts and all(isinstance(prompt, str) and prompt.strip() for prompt in prompts)
    assert not prompts[0].startswith("\ufeff")  # a byte-order mark is never part of the first prompt


@settings(max_examples=150, deadline=None)
@given(st.lists(ONE_LINE_PROMPTS, min_size=1, max_size=5), st.booleans())
def test_plain_lines_read_back_as_written(prompts, bom):
    text = ("\ufeff" if bom else "") + "\n".join(prompts) + "\n"
    assert _read(text.encode(), ".txt") == prompts


@settings(max_examples=150, deadline=None)
@given(st.lists(PROMPTS, min_size=1, max_size=5), st.booleans(), st.sampled_from([".jsonl", ".json"]))
def test_json_prompts_read_back_as_written(prompts, bom, suffix):
    if suffix == ".jsonl":
        text = "\n".join(json.dumps({"prompt": prompt}) for prompt in prompts)
    else:
        text = json.dumps(prompts)
    assert _read((("\ufeff" if bom else "") + text).encode(), suffix) == prompts


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_blank_prompt_is_refused_or_skipped_by_the_form(suffix):
    """Blank lines between plain-text prompts are skipped; in .jsonl and .json a blank prompt is a mistake."""
    blank = {".txt": "one\n   \ntwo\n", ".jsonl": '{"prompt": "one"}\n{"prompt": "  "}\n', ".json": '["one", " "]'}
    if suffix == ".txt":
        assert _read(blank[suffix].encode(), suffix) == ["one", "two"]
    else:
        with pytest.raises(ValueError, match="must be an object with a non-blank string `prompt`"):
            _read(blank[suffix].encode(), suffix)
