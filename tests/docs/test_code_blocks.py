"""Every code block of README.md and docs/**/*.md, run as a reader would run it.

Each fenced block is one test, `test_code_block[FILE:LINE MODE]`, read from the Markdown at test time. A block
runs as written unless an HTML comment on the line just above its fence says otherwise:

    <!-- docs-test: MODE ARGUMENT: why -->

- no marker: run as written. ```bash: each command, `mergecompose …` in this process, `make …` as a subprocess;
  ```python: executed; ```yaml: validated as a compare config.
- `check`: each command's pre-flight only: `mergecompose C …` with `--check` (every `C` of the block must have
  it), `make T` as `make -n T`; a ```python block is compiled and its imports run. The why says what the full run
  costs.
- `skip`: not run (a GPU, the hub, Ray, a server); pytest reports it as skipped, with the why.
- `synopsis`: a usage line with placeholders; every `--option` it names must be one its command accepts.
- `api`: a Python API example of the README; it must be one of the blocks `test_readme_examples.py` runs and checks.
- `file PATH`: the content of PATH, written into the working folder for the blocks after it (a `.py` file there
  imports by name in the ```python blocks, as it would for `python` run in that folder).
- `tiny`: ```python run with `base`, `expert_a`, `expert_b`, `ids` and `small_model` bound to tiny random Llamas.
- `layout`: a listing of the checkout; every folder (`name/`) and `.py` file it names exists, under its parent.

An unmarked block that fails to run fails its test, as does a ```lang with no way to run it, an unknown mode, or
a mode without its why. `check` and `skip` need a why; pytest's `-ra` summary lists the skipped ones with theirs.

The blocks of a page run in its order, in one working folder per session, as a reader's shell would: `models/smollm2`
is the real SmolLM2-135M-Instruct of the model cache (`smollm2_dir`), the experts a page trains or names
(`quickstart/{math,code}`, `adapters/{math,code}`) are the session's real SmolLM2 LoRA adapters
(`smollm2_adapters`: fewer steps than the README's recipe, whose training block is `check`), and `configs/` is a
copy of the checkout's, so that a config's relative paths land in the working folder. A block run alone (`-k`)
first runs the blocks above it on its page.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from markdown_it import MarkdownIt
from test_readme_examples import readme_blocks

from mergecompose.cli import build_parser, main
from mergecompose.composition import ComposedLM
from mergecompose.core.tiny import random_llama, tiny_llama_config
from mergecompose.experiments.compare_config import validate_compare_config

REPOSITORY = Path(__file__).resolve().parents[2]
PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").rglob("*.md"))]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<mode>[a-z]+)(?P<argument>[^:]*?)\s*(?::\s*(?P<why>.*?))?\s*-->$")
MODES = {"run", "check", "skip", "synopsis", "api", "file", "tiny", "layout"}
NEEDS_WHY = {"check", "skip"}
RUNNABLE = {"run": {"bash", "python", "yaml"}, "check": {"bash", "python"}, "tiny": {"python"}}
COMMANDS = ("mergecompose", ".venv/bin/mergecompose")


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int  # the page's line of the opening fence
    language: str
    code: str
    mode: str = "run"
    argument: str = ""
    why: str = ""

    @property
    def name(self) -> str:
        page = self.page.relative_to(REPOSITORY) if self.page.is_relative_to(REPOSITORY) else self.page
        return f"{page}:{self.line}"

    @property
    def id(self) -> str:
        return f"{self.name} {self.mode}"


def page_blocks(page: Path) -> list[CodeBlock]:
    """The fenced blocks of `page`, in order, each with the marker on the line above its fence."""
    text = page.read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks = []
    for token in MarkdownIt("commonmark").parse(text):
        if token.type not in ("fence", "code_block"):
            continue
        line = token.map[0]  # 0-based line of the fence
        above = lines[line - 1].strip() if line > 0 else ""
        marker = MARKER.match(above)
        fields = {}
        if marker:
            fields = {
                "mode": marker["mode"],
                "argument": marker["argument"].strip(),
                "why": (marker["why"] or "").strip(),
            }
        elif above.startswith("<!--") and "docs-test" in above:
            fields = {"mode": f"unreadable marker {above!r}"}
        blocks.append(CodeBlock(page, line + 1, token.info.strip(), token.content, **fields))
    return blocks


BLOCKS = [block for page in PAGES for block in page_blocks(page)]


# ---------------------------------------------------------------------------------------------
# The working folder, and running a page's blocks in order


class Reader:
    """A reader's working folder: the blocks of each page run once, in page order."""

    def __init__(self, root: Path, smollm2: Path, adapters: dict[str, Path]):
        self.root = root
        (root / "models").mkdir(parents=True)
        (root / "models" / "smollm2").symlink_to(smollm2, target_is_directory=True)
        for folder in ("quickstart", "adapters"):
            (root / folder).mkdir()
            for name, adapter in adapters.items():
                (root / folder / name).symlink_to(adapter, target_is_directory=True)
        shutil.copytree(REPOSITORY / "configs", root / "configs")
        self.done: dict[str, str | None] = {}  # block name -> None (ran) or the error that stopped it

    def run_through(self, block: CodeBlock) -> None:
        """Run the blocks above `block` on its page (each once), then `block`; raise on `block`'s failure."""
        for earlier in (b for b in BLOCKS if b.page == block.page and b.line <= block.line):
            if earlier.name not in self.done:
                try:
                    run_block(earlier, self)
                    self.done[earlier.name] = None
                except Exception as error:  # noqa: BLE001 - reported by its own test
                    self.done[earlier.name] = f"{type(error).__name__}: {error}"
        error = self.done[block.name]
        if error is not None:
            pytest.fail(f"{block.name} (```{block.language}, {block.mode}) does not run: {error}", pytrace=False)


def run_block(block: CodeBlock, reader: Reader) -> None:
    if block.mode not in MODES:
        raise AssertionError(f"unknown docs-test mode {block.mode!r}; the modes are {sorted(MODES)}")
    if block.mode in NEEDS_WHY and not block.why:
        raise AssertionError(f"a `{block.mode}` marker says why: <!-- docs-test: {block.mode}: why -->")
    if block.mode in RUNNABLE and block.language not in RUNNABLE[block.mode]:
        raise AssertionError(
            f"no way to {block.mode} a ```{block.language or '(no language)'} block; "
            f"give it a language of {sorted(RUNNABLE[block.mode])} or a docs-test marker (module docstring)"
        )
    if block.mode == "skip":
        return
    cwd = Path.cwd()
    os.chdir(reader.root)
    # As `python` run in the working folder has it: a module a page writes there (`file`) imports by name.
    sys.path.insert(0, str(reader.root))
    try:
        RUNNERS[block.mode](block, reader)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(reader.root))


def run_as_written(block: CodeBlock, reader: Reader) -> None:
    if block.language == "bash":
        for command in commands(block.code):
            run_command(command, check=False)
    elif block.language == "python":
        exec(compile(block.code, block.name, "exec"), {"__name__": "docs_example"})
    else:  # yaml: a compare config, validated as `mergecompose compare` reads it
        validate_compare_config(yaml.safe_load(block.code), reader.root / "configs" / "example.yaml")


def run_checks(block: CodeBlock, reader: Reader) -> None:
    if block.language == "bash":
        for command in commands(block.code):
            run_command(command, check=True)
        return
    tree = ast.parse(block.code, block.name)
    imports = [statement for statement in tree.body if isinstance(statement, (ast.Import, ast.ImportFrom))]
    assert imports, f"{block.name}: a `check` python block runs its imports, and this one has none"
    exec(compile(ast.Module(imports, type_ignores=[]), block.name, "exec"), {"__name__": "docs_example"})


def run_command(words: list[str], check: bool) -> None:
    """One shell command of a block: `mergecompose …` in this process, `make …` in the checkout."""
    if words[0] == "make":
        make = ["make", "-n", *words[1:]] if check else words
        result = subprocess.run(make, cwd=REPOSITORY, capture_output=True, text=True)
        assert result.returncode == 0, f"`{shlex.join(words)}` failed: {result.stderr.strip()}"
        return
    if words[0] not in COMMANDS:
        raise AssertionError(f"`{shlex.join(words)}`: the test runs `make` and `mergecompose` commands; mark the block")
    arguments = words[1:]
    if check:
        if "--check" not in subcommand_options(arguments[0]):
            raise AssertionError(f"`mergecompose {arguments[0]}` has no --check; a `check` block cannot hold it")
        arguments = [*arguments, "--check"]
    try:
        status = main(arguments)
    except SystemExit as exit:  # argparse's refusal of the arguments
        status = exit.code
    assert status == 0, f"`{shlex.join(words)}` exited with status {status}"


def check_synopsis(block: CodeBlock, reader: Reader) -> None:
    for words in commands(block.code):
        assert words[0] in COMMANDS, f"a synopsis shows a `mergecompose` command, not `{shlex.join(words)}`"
        accepted = subcommand_options(words[1])
        named = {re.sub(r"[\[\]]|=.*", "", word) for word in words[2:] if word.lstrip("[").startswith("--")}
        unknown = sorted(named - accepted)
        assert not unknown, f"`mergecompose {words[1]}` has no {unknown}; it accepts {sorted(accepted)}"


def check_api(block: CodeBlock, reader: Reader) -> None:
    examples = [example.code for example in readme_blocks()]
    assert block.code in examples, (
        f"{block.name} is marked `api`, but it is not one of the README's Python API examples that "
        "test_readme_examples.py runs; make it one of them, or run it here"
    )


def write_file(block: CodeBlock, reader: Reader) -> None:
    path = reader.root / block.argument
    assert block.argument and path.resolve().is_relative_to(reader.root.resolve()), block.argument
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.code, encoding="utf-8")


def run_tiny(block: CodeBlock, reader: Reader) -> None:
    config = tiny_llama_config()
    namespace = {
        "__name__": "docs_example",
        "ComposedLM": ComposedLM,
        "base": random_llama(config, seed=0),
        "expert_a": random_llama(config, seed=1),
        "expert_b": random_llama(config, seed=2),
        "small_model": random_llama(tiny_llama_config(num_layers=1), seed=3),
        "ids": torch.randint(4, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)),
    }
    exec(compile(block.code, block.name, "exec"), namespace)


def check_layout(block: CodeBlock, reader: Reader) -> None:
    """Each line's first word, if it names a folder (`x/`) or a `.py` file, exists under the folder above it."""
    parents: list[tuple[int, Path]] = []  # (indent, folder), outermost first
    missing, named = [], 0
    for line in block.code.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        word = line.split()[0]
        if not (word.endswith("/") or word.endswith(".py")):
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = (parents[-1][1] if parents else REPOSITORY) / word
        named += 1
        if not path.exists():
            missing.append(str(path.relative_to(REPOSITORY)))
        if word.endswith("/"):
            parents.append((indent, path))
    assert named, f"{block.name}: a `layout` block names folders (`x/`) or `.py` files, and this one names none"
    assert not missing, f"{block.name} names what the checkout does not have: {missing}"


RUNNERS = {
    "run": run_as_written,
    "check": run_checks,
    "synopsis": check_synopsis,
    "api": check_api,
    "file": write_file,
    "tiny": run_tiny,
    "layout": check_layout,
}


def commands(code: str) -> list[list[str]]:
    """A bash block's commands, as words: continuation lines joined, comments dropped, `&&` split."""
    joined = re.sub(r"\\\n", " ", code)
    found = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            if "&&" in words:
                index = words.index("&&")
                found.append(words[:index])
                words = words[index + 1 :]
            else:
                found.append(words)
                words = []
    return found


def subcommand_options(command: str) -> set[str]:
    parser = build_parser()
    (subparsers,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if command not in subparsers.choices:
        raise AssertionError(f"`mergecompose {command}` is no command; the commands are {sorted(subparsers.choices)}")
    return {option for action in subparsers.choices[command]._actions for option in action.option_strings}


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def reader(tmp_path_factory, smollm2_dir, smollm2_adapters):
    return Reader(tmp_path_factory.mktemp("reader"), smollm2_dir, smollm2_adapters)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_code_block(block, reader, capsys):
    if block.mode == "skip" and block.why:
        pytest.skip(f"{block.name}: {block.why}")
    reader.run_through(block)


def test_the_pages_have_blocks_of_every_kind():
    """The collection itself: every page is read, and the README's quick start is among the blocks that run.
    The session's summary counts the blocks by mode and outcome (`pytest_terminal_summary`, tests/conftest.py)."""
    modes = {block.mode for block in BLOCKS}
    assert {"run", "check", "skip", "api"} <= modes, modes
    assert {block.page for block in BLOCKS} >= {
        REPOSITORY / "README.md",
        REPOSITORY / "docs" / "guides" / "generate.md",
    }
    readme_runs = [block for block in BLOCKS if block.page.name == "README.md" and block.mode == "run"]
    assert any("mergecompose generate" in block.code for block in readme_runs), "the README's generate step must run"


# ---------------------------------------------------------------------------------------------
# The checks fail where they should: blocks of a page written here


BROKEN_PAGE = """\
<!-- docs-test: layout -->
```text
composition/
  model.py     exists
  no_such_module.py
```

```bash
mergecompose generate "hi" --base models/smollm2 --no-such-option
```

```text
an unmarked block in a language the test cannot run
```

<!-- docs-test: skip -->
```bash
a skip without its why
```

<!-- docs-test: synopsis -->
```bash
mergecompose overlap --base B --expert E --no-such-flag
```

<!-- docs-test: api -->
```python
print("not one of the README's examples")
```

<!-- docs-test: check: a check of a command that has no --check -->
```bash
mergecompose task-vector BASE FT
```

<!-- docs-test: rerun: an unknown mode -->
```bash
mergecompose --help
```
"""

BROKEN = {  # block index on BROKEN_PAGE -> what its failure says
    0: "no_such_module.py",
    1: "exited with status 2",
    2: "no way to run a ```text block",
    3: "a `skip` marker says why",
    4: "has no ['--no-such-flag']",
    5: "not one of the README's Python API examples",
    6: "has no --check",
    7: "unknown docs-test mode 'rerun'",
}


def test_each_check_fails_on_a_block_it_must_refuse(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(BROKEN_PAGE, encoding="utf-8")
    blocks = page_blocks(page)
    assert len(blocks) == len(BROKEN)
    (tmp_path / "empty").mkdir()
    reader = Reader(tmp_path / "reader", tmp_path / "empty", {"math": tmp_path / "empty"})
    for index, expected in BROKEN.items():
        with pytest.raises(AssertionError, match=re.escape(expected)):
            run_block(blocks[index], reader)


def test_commands_are_read_as_a_shell_reads_them():
    code = 'make run && mergecompose compare a.yaml \\\n    --out "runs/a b"   # a comment\n\nmake test\n'
    assert commands(code) == [
        ["make", "run"],
        ["mergecompose", "compare", "a.yaml", "--out", "runs/a b"],
        ["make", "test"],
    ]
