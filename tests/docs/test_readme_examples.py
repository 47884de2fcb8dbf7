"""The README's "Python API" examples, run as a user would run them, on tiny local models.

The ```python blocks are read from README.md at test time (never copied here), so an example
that stops working fails this test. Before a block runs, the names it takes for granted
(`base_model`, `expert_1`, `tokenizer`, `batches`, ...) are bound to tiny random Llamas (hidden
32, 2 layers, vocab 64), real peft LoRA adapters and safetensors checkpoints under a tmp folder,
and its placeholder paths ("path/to/math_lora", "ckpt/base", ...) are rewritten to those folders
(`placeholder_paths`). The blocks run in README order in one namespace, from a tmp working
directory (so "merged/" lands there), one top-level statement at a time: every value a
statement assigns or an expression statement shows is kept, so that each `lm`, `tau` and
`state` of a block is checked against an independent computation, not only the last one.

The experts are the LoRA adapters merged into copies of the base, saved as full checkpoints too,
so the README's three ways of building a composition, and of building a task vector, describe
the same experts and must agree.
"""

from __future__ import annotations

import ast
import copy
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mergecompose.analysis.data import char_tokenizer
from mergecompose.core.tiny import random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.merging import TaskVector

REPOSITORY = Path(__file__).resolve().parents[2]
README = REPOSITORY / "README.md"
SECTION = "## Python API"
BLOCK_TITLES = ["Composition", "Merging", "Analysis"]  # the ### heading above each ```python block
# 4 special tokens + 60 characters = the tiny models' 64 ids, so every generated id decodes.
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"
MATH_MODULES = None  # all linear layers
CODE_MODULES = ["q_proj", "v_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------
# Reading the README


@dataclass
class Block:
    title: str
    code: str
    first_line: int  # README line of the block's first code line


def readme_blocks(readme: Path = README) -> list[Block]:
    """The ```python blocks of the "Python API" section, in order, each with its ### heading."""
    lines = readme.read_text(encoding="utf-8").splitlines()
    if SECTION not in lines:
        raise AssertionError(f"README.md has no {SECTION!r} heading")
    start = lines.index(SECTION) + 1
    blocks, title, index = [], None, start
    while index < len(lines) and not lines[index].startswith("## "):
        line = lines[index]
        if line.startswith("### "):
            title = line[4:].strip()
        if line.strip() == "```python":
            end = index + 1
            while lines[end].strip() != "```":
                end += 1
            blocks.append(Block(title, "\n".join(lines[index + 1 : end]) + "\n", index + 2))
            index = end
        index += 1
    return blocks


def placeholder_paths(root: Path) -> dict[str, Path]:
    """The README's placeholder paths and the tmp folders standing in for them."""
    return {
        "path/to/base": root / "checkpoints" / "base",
        "path/to/math_lora": root / "adapters" / "math_lora",
        "path/to/code_lora": root / "adapters" / "code_lora",
        "ckpt/base": root / "checkpoints" / "base",
        "ckpt/math": root / "checkpoints" / "math",
        # The shipped config, unchanged: its `./checkpoints/...` folders are those under `root`,
        # the working directory the blocks run in.
        "configs/merge_ties.yaml": REPOSITORY / "configs" / "merge_ties.yaml",
    }


def rewrite_paths(code: str, paths: dict[str, Path]) -> str:
    for placeholder, path in paths.items():
        code = code.replace(repr(placeholder), repr(str(path))).replace(f'"{placeholder}"', repr(str(path)))
    left = re.findall(r"[\"'](?:path/to/|ckpt/|configs/)[^\"']*[\"']", code)
    if left:
        raise AssertionError(f"README placeholder paths {left} have no tmp stand-in; add them to `placeholder_paths`")
    return code


# ---------------------------------------------------------------------------------------------
# Running a block


@dataclass
class BlockRun:
    assigned: dict[str, list] = field(default_factory=lambda: defaultdict(list))  # name -> every value assigned
    shown: list = field(default_factory=list)  # values of the expression statements, in order
    error: str | None = None


def assigned_names(statement: ast.stmt) -> list[str]:
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    if isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    return [node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)]


def run_block(block: Block, code: str, namespace: dict) -> BlockRun:
    """Exec `code` one top-level statement at a time, keeping what each assigns or shows."""
    run = BlockRun()
    for statement in ast.parse(code).body:
        try:
            if isinstance(statement, ast.Expr):
                expression = ast.Expression(statement.value)
                run.shown.append(eval(compile(expression, str(README), "eval"), namespace))
            else:
                exec(compile(ast.Module([statement], type_ignores=[]), str(README), "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - reported as the README line that failed
            line = block.first_line + statement.lineno - 1
            source = block.code.splitlines()[statement.lineno - 1].strip()
            run.error = f"README.md line {line}, `{source}`: {type(error).__name__}: {error}"
            return run
        for name in assigned_names(statement):
            run.assigned[name].append(namespace[name])
    return run


# ---------------------------------------------------------------------------------------------
# The tiny world the examples run in


def merged_lora(base, adapter_dir: Path):
    """The base with a LoRA adapter merged in: the full-checkpoint form of that expert."""
    return PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload().eval()


def left_padded(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def model_logprobs(model, input_ids, attention_mask) -> torch.Tensor:
    """Log-probs `(B, T, V)` with the positions `ComposedLM` uses (left padding skipped)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return torch.log_softmax(logits.double(), dim=-1)


def compose_by_hand(components: torch.Tensor) -> torch.Tensor:
    """log p̂ = log p_b + Σ_i (log p_i − log p_b), renormalised; components `(k+1, ..., V)`, in float64."""
    logprobs = torch.log_softmax(components.double(), dim=-1)
    return torch.log_softmax(logprobs[0] + (logprobs[1:] - logprobs[0]).sum(0), dim=-1)


class ReadmeSession:
    """The namespace the README's blocks run in, with every placeholder bound; blocks run once, in order."""

    def __init__(self, root: Path):
        self.root = root
        self.blocks = readme_blocks()
        self.paths = placeholder_paths(root)
        self.runs: dict[str, BlockRun] = {}
        torch.manual_seed(0)
        config = tiny_llama_config()
        base = random_llama(config, seed=0)
        math_dir = random_lora_adapter(base, self.paths["path/to/math_lora"], seed=11, target_modules=MATH_MODULES)
        code_dir = random_lora_adapter(base, self.paths["path/to/code_lora"], seed=12, target_modules=CODE_MODULES)
        expert_1, expert_2 = merged_lora(base, math_dir), merged_lora(base, code_dir)
        tokenizer = char_tokenizer(CHARACTERS)
        tokenizer.padding_side = "left"
        checkpoints = root / "checkpoints"
        for name, model in [("base", base), ("math", expert_1), ("code", expert_2)]:
            model.save_pretrained(checkpoints / name)
        tokenizer.save_pretrained(checkpoints / "base")

        self.config = config
        self.base_state = {name: tensor.clone() for name, tensor in base.state_dict().items()}
        self.experts = [expert_1, expert_2]
        prompt = left_padded(tokenizer, ["abcabc", "hello", "xyz"])  # (3, 6)
        self.base_logprobs_before = model_logprobs(base, prompt["input_ids"], prompt["attention_mask"])
        batches = [
            left_padded(tokenizer, ["the quick brown fox", "jumps over", "the lazy dog"]),
            left_padded(tokenizer, ["abcdefghij", "ABCDEFG01234"]),
        ]
        for batch in batches:  # every real position whose next token is observed
            batch["measure_mask"] = batch["attention_mask"].bool().clone()
            batch["measure_mask"][:, -1] = False
        generator = torch.Generator().manual_seed(0)
        shape = (2, 5, config.vocab_size)
        self.namespace = {
            "__name__": "readme_example",
            # Composition
            "base_logits": torch.randn(shape, generator=generator) * 3,
            "expert_1_logits": torch.randn(shape, generator=generator) * 3,
            "expert_2_logits": torch.randn(shape, generator=generator) * 3,
            "base_model": base,
            "expert_1": expert_1,
            "expert_2": expert_2,
            "tokenizer": tokenizer,
            **prompt,
            # Merging
            "expert": expert_1,
            "other": TaskVector.from_models(base, expert_2),
            "math_expert": expert_1,
            "code_expert": expert_2,
            "experts": [expert_1, expert_2],
            "tau_math": TaskVector.from_lora(base, math_dir),
            "tau_code": TaskVector.from_lora(base, code_dir),
            # Analysis
            "batches": batches,
            "merged": self.task_arithmetic_model(base, [expert_1, expert_2]),
            "prompt_batches": [left_padded(tokenizer, ["abc", "hello"]), left_padded(tokenizer, ["xyz01"])],
        }

    @staticmethod
    def task_arithmetic_model(base, experts):
        """θ_b + Σ_i (θ_i − θ_b), by hand: the merge the composition (weights 1) is compared with."""
        merged = copy.deepcopy(base)
        base_state = base.state_dict()
        states = [expert.state_dict() for expert in experts]
        merged.load_state_dict(
            {name: tensor + sum(s[name] - tensor for s in states) for name, tensor in base_state.items()}
        )
        return merged.eval()

    def run(self, title: str) -> BlockRun:
        """Run every block up to `title` (each once, in README order) and return `title`'s run.

        A failed block does not stop the later ones, as in a notebook; its failure is reported by
        its own test."""
        titles = [block.title for block in self.blocks]
        if title not in titles:
            raise AssertionError(f"README's {SECTION!r} has no ```python block under '### {title}'; it has {titles}")
        for block in self.blocks:
            if block.title not in self.runs:
                code = rewrite_paths(block.code, self.paths)
                self.runs[block.title] = run_block(block, code, self.namespace)
            if block.title == title:
                break
        run = self.runs[title]
        if run.error is not None:
            earlier = [f"{t}: {r.error}" for t, r in self.runs.items() if t != title and r.error is not None]
            pytest.fail(
                f"README 'Python API' example '### {title}' does not run as written: {run.error}"
                + (f" (earlier blocks also failed: {earlier})" if earlier else ""),
                pytrace=False,
            )
        return run


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        yield ReadmeSession(root)


def assert_full_state_dict(state, base_state, config):
    """`state` has the base's names, shapes and dtypes and loads strictly into a fresh model."""
    assert set(state) == set(base_state)
    for name, tensor in base_state.items():
        assert state[name].shape == tensor.shape and state[name].dtype == tensor.dtype, name
    random_llama(config, seed=99).load_state_dict(state, strict=True)


def delta(state, base_state) -> torch.Tensor:
    return torch.cat(
        [(state[name] - tensor).flatten() for name, tensor in base_state.items() if tensor.is_floating_point()]
    )


# ---------------------------------------------------------------------------------------------
# The tests


def test_readme_python_blocks_are_all_covered(session):
    """A new ```python block in the section needs checks here; a renamed placeholder path needs a stand-in."""
    assert [block.title for block in session.blocks] == BLOCK_TITLES
    section = "".join(block.code for block in session.blocks)
    unused = [placeholder for placeholder in session.paths if f'"{placeholder}"' not in section]
    assert not unused, f"placeholder paths {unused} no longer appear in the README; drop them from `placeholder_paths`"


def test_composition_block(session):
    run = session.run("Composition")
    ns = session.namespace
    base_model, tokenizer = ns["base_model"], ns["tokenizer"]
    input_ids, attention_mask = ns["input_ids"], ns["attention_mask"]
    batch, length, vocab = input_ids.shape[0], input_ids.shape[1], session.config.vocab_size
    real = attention_mask.bool()  # (B, T)

    # The rule on tensors: equal to the formula by hand, float32.
    composed = ns["composed"]
    assert composed.dtype == torch.float32 and composed.shape == ns["base_logits"].shape
    expected = compose_by_hand(torch.stack([ns["base_logits"], ns["expert_1_logits"], ns["expert_2_logits"]]))
    torch.testing.assert_close(composed.double(), expected, atol=1e-5, rtol=0)

    # Three ways of building the composition of the same two experts; the names each one gives.
    full, adapters, pretrained = run.assigned["lm"]
    assert full.expert_names == ["expert_0", "expert_1"]
    assert adapters.expert_names == ["math", "code"]
    assert pretrained.expert_names == ["math_lora", "code_lora"]  # the adapter folders' names
    assert ns["lm"] is pretrained

    # components: (k+1, B, T, V), base first, each the component model's own log-probs.
    components = ns["components"]
    assert components.shape == (3, batch, length, vocab)
    for index, model in enumerate([base_model, *session.experts]):
        reference = model_logprobs(model, input_ids, attention_mask)  # (B, T, V)
        torch.testing.assert_close(components[index][real].double(), reference[real], atol=1e-4, rtol=0)
    for other in (full, adapters):
        torch.testing.assert_close(
            other.component_logprobs(input_ids, attention_mask)[:, real], components[:, real], atol=1e-4, rtol=0
        )

    # logprobs: (B, T, V), the composition of the components.
    logprobs = ns["logprobs"]
    assert logprobs.shape == (batch, length, vocab)
    torch.testing.assert_close(logprobs[real].double(), compose_by_hand(components)[real], atol=1e-5, rtol=0)

    # out: the prompt, then greedy tokens of the composed distribution up to EOS, then padding.
    out = ns["out"]
    assert out.shape[0] == batch and length < out.shape[1] <= length + 64
    assert torch.equal(out[:, :length], input_ids)
    full_mask = torch.cat([attention_mask, torch.ones_like(out[:, length:])], dim=1)
    teacher_forced = ns["lm"].logprobs(out, full_mask)  # (B, T + n, V)
    checked = 0
    for row in range(batch):
        for column in range(length, out.shape[1]):
            assert out[row, column] == teacher_forced[row, column - 1].argmax(), (row, column)
            checked += 1
            if out[row, column] == tokenizer.eos_token_id:
                assert (out[row, column + 1 :] == tokenizer.pad_token_id).all()
                break
    assert checked >= batch

    # The README never closes the from_adapters composition: the base model must still be itself.
    torch.testing.assert_close(
        model_logprobs(base_model, input_ids, attention_mask)[real], session.base_logprobs_before[real], atol=0, rtol=0
    )
    for name, tensor in base_model.state_dict().items():
        assert torch.equal(tensor, session.base_state[name]), name


def test_merging_block(session):
    run = session.run("Merging")
    ns = session.namespace
    base_model, base_state, config = ns["base_model"], session.base_state, session.config
    expert_1, expert_2 = session.experts
    by_hand = {name: expert_1.state_dict()[name] - tensor for name, tensor in base_state.items()}  # τ_math

    # Three task vectors of the math expert: from the models, from its checkpoint, from its adapter.
    from_models, from_checkpoints, from_lora = run.assigned["tau"]
    for name, tensor in by_hand.items():
        torch.testing.assert_close(from_models.tensors[name], tensor, atol=0, rtol=0)
        torch.testing.assert_close(from_checkpoints.tensors[name], tensor, atol=0, rtol=0)
    assert set(from_lora.tensors) == {name for name, tensor in by_hand.items() if tensor.abs().max() > 0}
    for name, tensor in from_lora.tensors.items():
        torch.testing.assert_close(tensor, by_hand[name], atol=1e-6, rtol=0)

    # tau.norm(); tau.cosine(other); (tau + other) * 0.5; tau.apply_to(base_model) — tau is the LoRA one here.
    tau, other = ns["tau"], ns["other"]
    norm, cosine, half_sum, applied = run.shown[:4]
    assert norm == pytest.approx(math.sqrt(sum(float(t.double().pow(2).sum()) for t in tau.tensors.values())), rel=1e-9)
    dot = sum(float((t.double() * other.tensors[n].double()).sum()) for n, t in tau.tensors.items())
    assert cosine == pytest.approx(dot / (tau.norm() * other.norm()), rel=1e-9) and -1 <= cosine <= 1
    for name in set(tau.tensors) | set(other.tensors):
        expected = 0.5 * (tau.tensors.get(name, 0) + other.tensors.get(name, 0))
        torch.testing.assert_close(half_sum.tensors[name], expected, atol=1e-7, rtol=0)
    assert applied is not base_model
    for name, tensor in applied.state_dict().items():
        torch.testing.assert_close(tensor, expert_1.state_dict()[name], atol=1e-6, rtol=0)

    # Each `state`: a full state dict of the base, loadable; the base model itself untouched.
    ties, dare_ties, ties_mergekit = run.assigned["state"]
    for state in (ties, dare_ties, ties_mergekit):
        assert_full_state_dict(state, base_state, config)
    for name, tensor in base_model.state_dict().items():
        assert torch.equal(tensor, base_state[name]), name
    tau_1 = delta(expert_1.state_dict(), base_state)
    tau_2 = delta(expert_2.state_dict(), base_state)

    # TIES (density 0.2, λ 1): a sparse delta; each kept entry averages agreeing entries, so it
    # takes the sign of, and is no larger than, the largest input entry of that sign.
    ties_delta = delta(ties, base_state)
    kept = ties_delta != 0
    assert 0 < kept.float().mean() <= 0.4
    same_sign = torch.where(ties_delta > 0, torch.maximum(tau_1, tau_2), torch.minimum(tau_1, tau_2))
    assert (ties_delta[kept].abs() <= same_sign[kept].abs() + 1e-6).all()
    assert (torch.sign(same_sign[kept]) == torch.sign(ties_delta[kept])).all()

    # DARE-TIES (drop 0.9, seed 0), written to merged/: sparse, reproducible, and what is on disk.
    assert (delta(dare_ties, base_state) != 0).float().mean() <= 0.25
    merged_dir = session.root / "merged"
    assert (merged_dir / "merge_settings.yaml").is_file()
    assert yaml.safe_load((merged_dir / "merge_settings.yaml").read_text())["settings"]["drop_rate"] == 0.9
    on_disk = AutoModelForCausalLM.from_pretrained(merged_dir).state_dict()
    for name, tensor in dare_ties.items():
        assert torch.equal(on_disk[name], tensor), name

    # In mergekit mode, the in-memory TIES of the two experts is what mergekit computes on disk
    # from the shipped configs/merge_ties.yaml (density 0.2, λ 1 over the same checkpoints).
    written = [path.parent for path in session.root.glob("*/mergekit_config.yml")]
    assert len(written) == 1, f"expected one merge_checkpoints output under the working directory, got {written}"
    assert (written[0] / "mergecompose_config.yaml").is_file()
    mergekit_state = load_file(str(written[0] / "model.safetensors"))
    assert set(mergekit_state) == set(ties_mergekit)
    for name, tensor in ties_mergekit.items():
        torch.testing.assert_close(mergekit_state[name], tensor, atol=1e-6, rtol=0)
    ties_mergekit_delta = delta(ties_mergekit, base_state)
    assert ties_mergekit_delta.abs().max() > 1e-3
    assert not torch.allclose(ties_mergekit_delta, ties_delta)  # the paper's TIES is another merge


def test_analysis_block(session):
    run = session.run("Analysis")
    ns = session.namespace
    lm, batches, merged = ns["lm"], ns["batches"], ns["merged"]
    epsilon = 0.1

    # report.to_dict(): the documented keys, and the numbers the README names, recomputed by hand.
    (summary,) = run.shown
    assert summary == ns["report"].to_dict()
    for key in ("coactivation_rate", "experts", "pairs", "projective_error", "merge_compose_gap"):
        assert key in summary, key
    assert list(summary["experts"]) == lm.expert_names == ["math_lora", "code_lora"]
    assert list(summary["pairs"]) == ["math_lora|code_lora"]
    pair = summary["pairs"]["math_lora|code_lora"]
    for key in ("mass_overlap", "sign_conflict", "parameter"):
        assert key in pair, key
    assert pair["parameter"], "task_vectors= gave no parameter-space measures"

    kl_sums, active_both, gap_sum, positions = torch.zeros(2, dtype=torch.float64), 0, 0.0, 0
    for batch in batches:
        measured = batch["measure_mask"] & batch["attention_mask"].bool()  # (B, T)
        components = lm.component_logprobs(batch["input_ids"], batch["attention_mask"]).double()[
            :, measured
        ]  # (3, N, V)
        kl = (components[1:].exp() * (components[1:] - components[0])).sum(-1)  # (2, N) KL(p_i ‖ p_b)
        kl_sums += kl.sum(-1)
        active_both += int(((kl > epsilon).sum(0) >= 2).sum())
        composed = compose_by_hand(components)  # (N, V)
        merged_logprobs = model_logprobs(merged, batch["input_ids"], batch["attention_mask"])[measured]
        gap_sum += float((composed.exp() * (composed - merged_logprobs)).sum(-1).sum())  # KL(q ‖ m)
        positions += int(measured.sum())
    for index, name in enumerate(lm.expert_names):
        assert summary["experts"][name]["kl_mean"] == pytest.approx(float(kl_sums[index]) / positions, rel=1e-3)
        assert 0 <= summary["experts"][name]["active_fraction"] <= 1
    assert summary["coactivation_rate"] == pytest.approx(active_both / positions, abs=1e-9)
    assert summary["merge_compose_gap"]["kl_mean"] == pytest.approx(gap_sum / positions, rel=1e-3)

    # rolled: one batch per prompt batch: the prompt, then the composition's own greedy tokens,
    # measured at the positions that produced them.
    rolled = ns["rolled"]
    assert len(rolled) == len(ns["prompt_batches"])
    for prompts, batch in zip(ns["prompt_batches"], rolled):
        prompt_length = prompts["input_ids"].shape[1]
        assert torch.equal(batch["input_ids"][:, :prompt_length], prompts["input_ids"])
        measured = batch["measure_mask"]
        assert measured[:, : prompt_length - 1].sum() == 0 and (measured.sum(-1) >= 1).all()
        greedy = lm.logprobs(batch["input_ids"], batch["attention_mask"]).argmax(-1)  # (B, P + n)
        rows, columns = measured.nonzero(as_tuple=True)
        assert torch.equal(batch["input_ids"][rows, columns + 1], greedy[rows, columns])
