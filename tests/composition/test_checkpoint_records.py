"""What real checkpoints record about themselves: padded vocabulary rows, and the base an adapter was made for.

A padded checkpoint (embeddings resized to a multiple of 64) composes over the vocabulary it shares with the
others, as the unpadded one would; rows that are real tokens are refused, before any weights load. An adapter
whose recorded base names another model than the base given gets a UserWarning naming both.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from mergecompose.analysis.data import char_tokenizer
from mergecompose.composition import ComposedLM
from mergecompose.composition.vocabulary import shared_vocabulary, with_vocabulary
from mergecompose.core.adapters import is_other_base, recorded_base
from mergecompose.core.tiny import left_padded_batch, random_llama, random_lora_adapter, tiny_llama_config
from mergecompose.merging import TaskVector

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # + 4 special tokens = 64 ids
PADDED = 128  # 64 rows resized up to the next multiple of 64


def padded(model, rows=PADDED, seed=7):
    """A copy of `model` with `rows` output rows; the extra ones are large, so that they would win if not ruled out."""
    bigger = copy.deepcopy(model)
    bigger.resize_token_embeddings(rows, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        extra = bigger.lm_head.weight[model.config.vocab_size :]
        extra.copy_(20 * torch.randn(extra.shape, generator=generator))
    return bigger


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = char_tokenizer(CHARACTERS)
    assert len(tokenizer) == 64
    return tokenizer


@pytest.fixture(scope="module")
def padded_expert(expert_models):
    return padded(expert_models[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory, base_model, expert_models, padded_expert, tokenizer):
    """base/ (with the tokenizer), expert/, padded/ (128 rows) and padded_base/ (128 rows, the tokenizer)."""
    root = tmp_path_factory.mktemp("records")
    for name, model in [
        ("base", base_model),
        ("expert", expert_models[0]),
        ("padded", padded_expert),
        ("padded_base", padded(base_model)),
    ]:
        model.save_pretrained(root / name)
    tokenizer.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "padded_base")
    return root


@pytest.fixture
def no_weights_load(monkeypatch):
    """Fail the test if any model's weights load (the checks must come first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the check")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


# ----------------------------------------------------------------------------- padded vocabulary rows


def test_shared_vocabulary_rule():
    assert shared_vocabulary([("`a`", 64), ("`b`", 64)], None) == 64
    assert shared_vocabulary([("`a`", 64), ("`b`", 128)], 64) == 64
    assert shared_vocabulary([("`a`", 128), ("`b`", 64), ("`c`", 128)], 50) == 64
    with pytest.raises(ValueError, match=r"`b` has 128 output tokens, `a` has 64; without a tokenizer"):
        shared_vocabulary([("`a`", 64), ("`b`", 128)], None)
    with pytest.raises(ValueError, match=r"`b` has 128 .* `a` has 64, and the tokenizer has ids up to 69"):
        shared_vocabulary([("`a`", 64), ("`b`", 128)], 70)


def test_with_vocabulary_cuts_views_and_leaves_the_model(padded_expert, expert_models):
    cut = with_vocabulary(padded_expert, 64)
    assert padded_expert.lm_head.weight.shape[0] == PADDED  # unchanged
    assert cut.lm_head.weight.shape[0] == cut.model.embed_tokens.weight.shape[0] == cut.config.vocab_size == 64
    assert cut.lm_head.weight.data_ptr() == padded_expert.lm_head.weight.data_ptr()  # a view, not a copy
    assert with_vocabulary(expert_models[0], 64) is expert_models[0]
    ids = torch.tensor([[5, 9, 14, 3]])
    torch.testing.assert_close(cut(ids).logits, expert_models[0](ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("do_sample", [False, True])
def test_padded_expert_composes_as_the_unpadded_one(base_model, expert_models, padded_expert, tokenizer, do_sample):
    ids, mask = left_padded_batch([5, 3])
    assert (padded_expert(ids, attention_mask=mask).logits[..., -1, :].argmax(-1) >= 64).all()  # padding would win
    plain = ComposedLM(base_model, [expert_models[0]], weights=[0.7], tokenizers=tokenizer)
    with_padding = ComposedLM(base_model, [padded_expert], weights=[0.7], tokenizers=tokenizer)
    assert with_padding.vocab_size == 64
    torch.testing.assert_close(with_padding.logprobs(ids, mask), plain.logprobs(ids, mask), rtol=0, atol=1e-5)
    options = dict(max_new_tokens=8, do_sample=do_sample, seed=3, eos_token_id=2, pad_token_id=0)
    assert torch.equal(with_padding.generate(ids, mask, **options), plain.generate(ids, mask, **options))
    # A fixed K: with the adaptive one, which tokens a seed draws depends on timings
    # (composition/speculative/draft_length.py).
    merged = dict(options, draft="merged", num_draft_tokens=2, adaptive_draft=False)
    assert torch.equal(with_padding.generate(ids, mask, **merged), plain.generate(ids, mask, **merged))


def test_padded_base_composes_as_the_unpadded_one(base_model, expert_models, tokenizer):
    ids, mask = left_padded_batch([4, 6])
    plain = ComposedLM(base_model, expert_models, tokenizers=tokenizer)
    with_padding = ComposedLM(padded(base_model), expert_models, tokenizers=tokenizer)
    torch.testing.assert_close(with_padding.logprobs(ids, mask), plain.logprobs(ids, mask), rtol=0, atol=1e-5)
    options = dict(max_new_tokens=6, eos_token_id=2, pad_token_id=0)
    assert torch.equal(with_padding.generate(ids, mask, **options), plain.generate(ids, mask, **options))


def test_from_pretrained_with_a_padded_expert(folders):
    ids, mask = left_padded_batch([5, 2])
    plain = ComposedLM.from_pretrained(folders / "base", [folders / "expert"], weights=[0.5])
    with_padding = ComposedLM.from_pretrained(folders / "base", [folders / "padded"], weights=[0.5])
    assert with_padding.vocab_size == 64
    options = dict(max_new_tokens=6, eos_token_id=2, pad_token_id=0)
    assert torch.equal(with_padding.generate(ids, mask, **options), plain.generate(ids, mask, **options))


def test_padded_rows_that_are_tokens_are_refused_before_loading(folders, checkpoints, no_weights_load, tmp_path):
    long_tokenizer = char_tokenizer(CHARACTERS + "89+-*/")  # 70 ids: 6 beyond the base's 64 rows
    base = tmp_path / "base"
    base.mkdir()
    for name in ["config.json", "model.safetensors"]:
        (base / name).symlink_to(folders / "base" / name)
    long_tokenizer.save_pretrained(base)
    padded_folder = str(folders / "padded")
    with pytest.raises(ValueError, match=rf"`experts\[1\]` '{padded_folder}' has 128 .* `base` .* 64, and the tok"):
        ComposedLM.from_pretrained(base, [checkpoints / "expert_0", padded_folder])
    with pytest.raises(ValueError, match=r"`experts\[0\]` .* has 128 .* `base` .* has 64; without a tokenizer"):
        ComposedLM.from_pretrained(checkpoints / "base", [padded_folder])  # no tokenizer: cannot tell padding


def test_vocabulary_of_other_sizes_is_still_refused(base_model, tokenizer):
    other = random_llama(tiny_llama_config(vocab_size=80), seed=3)  # 80: not padding of 64 ids, yet beyond them
    ComposedLM(base_model, [other], tokenizers=tokenizer)  # the tokenizer's 64 ids fit: rows 64..79 are ruled out
    with pytest.raises(ValueError, match=r"`expert_models\[0\]` has 80 .* `base_model` has 64; without a tokenizer"):
        ComposedLM(base_model, [other])


@pytest.fixture(scope="module")
def resized_adapter(tmp_path_factory, base_model):
    """An adapter trained with embeddings resized to 128 rows, which it saves whole (`modules_to_save`)."""
    bigger = padded(base_model)
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    folder = tmp_path_factory.mktemp("resized") / "adapter"
    get_peft_model(bigger, config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("lora_implementation", ["stacked", "peft"])
def test_adapter_with_resized_embeddings_is_refused(base_model, resized_adapter, lora_implementation):
    sizes = r"with shape \(128, 32\), but the base's `(lm_head|model.embed_tokens).weight` has shape \(64, 32\)"
    ids = torch.tensor([[5, 9, 14]])
    before = base_model(ids).logits
    with pytest.raises(ValueError, match=rf"adapter `a` saves `base_model.model.*` whole {sizes}: a vocabulary of 128"):
        ComposedLM.from_adapters(base_model, {"a": str(resized_adapter)}, lora_implementation=lora_implementation)
    assert torch.equal(base_model(ids).logits, before)  # left as it was
    assert not any("lora" in name or "modules_to_save" in name for name, _ in base_model.named_modules())
    with pytest.raises(ValueError, match=rf"saves .* whole {sizes}"):
        TaskVector.from_lora(base_model, resized_adapter)


def test_adapter_with_resized_embeddings_is_refused_before_loading(checkpoints, resized_adapter, no_weights_load):
    with pytest.raises(ValueError, match=r"adapter `experts\[0\]` saves .* \(128, 32\).* \(64, 32\): a vocabulary"):
        ComposedLM.from_pretrained(checkpoints / "base", [resized_adapter])


# ----------------------------------------------------------------------------- the base an adapter records


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, checkpoints, tiny_config):
    """Adapters trained on models loaded from folders, so that they record them: same/ on base/, other/ on other/."""
    root = tmp_path_factory.mktemp("recorded")
    random_llama(tiny_config, seed=5).save_pretrained(root / "other_base")  # same shapes, another model
    on_base = AutoModelForCausalLM.from_pretrained(checkpoints / "base")
    on_other = AutoModelForCausalLM.from_pretrained(root / "other_base")
    random_lora_adapter(on_base, root / "same", seed=1)
    random_lora_adapter(on_other, root / "other", seed=2)
    return root


def ours(caught):
    return [
        str(w.message) for w in caught if issubclass(w.category, UserWarning) and "records its base" in str(w.message)
    ]


def test_recorded_base_is_read_from_the_config(recorded, checkpoints, lora_dirs):
    assert recorded_base(recorded / "same") == str(checkpoints / "base")
    assert recorded_base(lora_dirs["ab"]) is None  # made on a model built in memory: nothing recorded


def test_which_records_name_another_base(tmp_path, checkpoints, monkeypatch):
    base = checkpoints / "base"
    monkeypatch.chdir(base.parent)
    assert not is_other_base(None, base)
    assert not is_other_base(str(base), base)
    assert not is_other_base("./base/", str(base))  # the same folder, however written
    assert not is_other_base(str(base), AutoModelForCausalLM.from_pretrained(base))  # a model: where it was loaded from
    assert is_other_base(str(checkpoints / "expert_0"), base)  # another existing folder
    assert not is_other_base("HuggingFaceTB/SmolLM2-135M-Instruct", base)  # a folder without records: not clear
    assert not is_other_base("/home/someone/models/smol", base)  # a path on another machine: not clear
    assert is_other_base("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_other_base("someone/smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")  # a mirror
    hub_cache = "/cache/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0123abc"
    assert not is_other_base(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_other_base(hub_cache, "HuggingFaceTB/SmolLM2-360M-Instruct")

    fetched = tmp_path / "fetched"  # as `mergecompose fetch-model` writes it
    fetched.mkdir()
    (fetched / "conversion.json").write_text(
        json.dumps({"model": "smollm2-135m-instruct", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"})
    )
    assert not is_other_base("HuggingFaceTB/SmolLM2-135M-Instruct", fetched)
    assert is_other_base("HuggingFaceTB/SmolLM2-360M", fetched)
    older = tmp_path / "older"  # config.json written by a transformers that kept `_name_or_path`
    older.mkdir()
    (older / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "meta-llama/Llama-3.2-1B"}))
    assert not is_other_base("meta-llama/Llama-3.2-1B", older)
    assert is_other_base("meta-llama/Llama-3.1-8B", older)


def test_from_adapters_warns_naming_both(recorded, checkpoints, lora_dirs):
    base = AutoModelForCausalLM.from_pretrained(checkpoints / "base")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ComposedLM.from_adapters(base, {"same": str(recorded / "same"), "none": str(lora_dirs["ab"])}).close()
    assert ours(caught) == []
    with pytest.warns(
        UserWarning, match=r"`adapters\['other'\]` records its base as '.*other_base'.* given is '.*base'"
    ):
        ComposedLM.from_adapters(base, {"other": str(recorded / "other")}).close()


def test_from_pretrained_warns_before_loading(recorded, checkpoints, no_weights_load):
    with pytest.warns(UserWarning, match=r"`experts\[1\]` records its base as '.*other_base'"):
        with pytest.raises(AssertionError, match="weights were loaded"):  # the warning came first
            ComposedLM.from_pretrained(checkpoints / "base", [recorded / "same", recorded / "other"])


def test_task_vector_from_lora_warns(recorded, checkpoints):
    base = AutoModelForCausalLM.from_pretrained(checkpoints / "base")
    with pytest.warns(UserWarning, match=r"`adapter` records its base as '.*other_base'"):
        TaskVector.from_lora(base, recorded / "other")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TaskVector.from_lora(base, recorded / "same")
    assert ours(caught) == []
