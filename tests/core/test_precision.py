"""`dtype: auto` and the slow-bfloat16 warning (mergecompose.core.precision), on both kinds of CPU.

Which kind this machine is does not matter: `fast_bfloat16` is replaced by each answer in turn."""

from __future__ import annotations

import pytest

from mergecompose.core import precision
from mergecompose.core.precision import resolve_dtype, slow_dtype_problem
from mergecompose.studies import chat_training
from mergecompose.studies.math_code import experts
from mergecompose.studies.math_code.experts import ExpertRecipe, expert_folder


@pytest.mark.parametrize("fast", [True, False])
def test_auto_is_bfloat16_exactly_where_bfloat16_is_fast(fast, monkeypatch):
    monkeypatch.setattr(precision, "fast_bfloat16", lambda device="cpu": fast)
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if fast else "float32")
    for name in ("float32", "float16", "bfloat16"):
        assert resolve_dtype(name, "cpu") == name  # an explicit choice is kept


def test_an_explicit_bfloat16_where_it_is_slow_is_named_with_its_field(monkeypatch):
    monkeypatch.setattr(precision, "fast_bfloat16", lambda device="cpu": False)
    problem = slow_dtype_problem("bfloat16", "cpu", "experts.math.autocast")
    assert problem is not None
    assert problem.startswith("`experts.math.autocast` is 'bfloat16'") and "`experts.math.autocast: auto`" in problem
    assert slow_dtype_problem("float32", "cpu", "dtype") is None
    assert slow_dtype_problem("auto", "cpu", "dtype") is None
    monkeypatch.setattr(precision, "fast_bfloat16", lambda device="cpu": True)
    assert slow_dtype_problem("bfloat16", "cpu", "dtype") is None


@pytest.mark.parametrize("fast", [True, False])
def test_an_auto_expert_recipe_is_keyed_by_what_it_trains_in(fast, monkeypatch, tmp_path):
    """`autocast: auto` trains in bfloat16 where it is fast, float32 elsewhere; its cache key is the resolved recipe's,
    so an expert trained under the old default (`bfloat16`) on a fast CPU is found again."""
    monkeypatch.setattr(chat_training, "fast_bfloat16", lambda device="cpu": fast)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    auto = ExpertRecipe(skill="math", examples=4)
    explicit = ExpertRecipe(skill="math", examples=4, autocast="bfloat16" if fast else None)
    other = ExpertRecipe(skill="math", examples=4, autocast=None if fast else "bfloat16")
    assert experts.resolved(auto) == explicit
    assert expert_folder(base, auto, tmp_path) == expert_folder(base, explicit, tmp_path)
    assert expert_folder(base, auto, tmp_path) != expert_folder(base, other, tmp_path)
