"""ComposedLM on tiny random Llama models and real peft LoRA adapters."""

import warnings
from dataclasses import replace

import pytest
import torch
from peft import PeftModel
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaForCausalLM, TextStreamer
from transformers.generation.streamers import BaseStreamer

from mergecompose.composition import ComposedLM, DecodingConfig, compose_logprobs
from mergecompose.composition.kernels.packed_weights import PACKED
from mergecompose.core.tiny import EOS, PAD, left_padded_batch, random_llama, random_lora_adapter, tiny_llama_config


def naive_greedy(models, weights, input_ids, attention_mask, max_new_tokens, eos=EOS, pad=PAD, stride=1):
    """Re-run every model on the whole prefix at every step (no cache), compose, take the argmax.

    Token j of a row (padding skipped) sits at position `stride · j`.
    """
    ids, mask = input_ids.clone(), attention_mask.clone()
    finished = torch.zeros(ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        positions = stride * (mask.cumsum(-1) - 1).clamp(min=0)
        logits = [m(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1] for m in models]
        scores = compose_logprobs(logits[0], logits[1:], weights)
        next_tokens = torch.where(finished, torch.tensor(pad), scores.argmax(-1))
        ids = torch.cat([ids, next_tokens[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        finished |= next_tokens == eos
        if finished.all():
            break
    return ids


@pytest.fixture(scope="module")
def composed_full(base_model, expert_models):
    return ComposedLM(base_model, expert_models)


@pytest.fixture(scope="module")
def composed_lora(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)  # a private copy: from_adapters injects LoRA layers in place
    return ComposedLM.from_adapters(base, {name: str(path) for name, path in lora_dirs.items()})


def merged_adapter_model(tiny_config, adapter_dir):
    base = random_llama(tiny_config, seed=0)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


# ----------------------------------------------------------------------------- scoring


def test_component_logprobs_shape_and_order(composed_full, base_model, expert_models):
    ids, mask = left_padded_batch([5, 7, 3])
    components = composed_full.component_logprobs(ids, mask)
    assert components.shape == (3, 3, 7, 64)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for index, model in enumerate([base_model, *expert_models]):
        expected = torch.log_softmax(model(input_ids=ids, attention_mask=mask, position_ids=positions).logits, -1)
        torch.testing.assert_close(components[index], expected)
    composed = composed_full.logprobs(ids, mask)
    torch.testing.assert_close(composed, compose_logprobs(components[0], list(components[1:])))


def test_from_adapters_matches_separately_merged_models(composed_lora, tiny_config, lora_dirs):
    ids, mask = left_padded_batch([6, 4], seed=3)
    merged = [merged_adapter_model(tiny_config, lora_dirs[name]) for name in ["ab", "cd"]]
    reference = ComposedLM(random_llama(tiny_config, seed=0), merged)
    torch.testing.assert_close(
        composed_lora.component_logprobs(ids, mask), reference.component_logprobs(ids, mask), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(composed_lora.logprobs(ids, mask), reference.logprobs(ids, mask), atol=1e-5, rtol=0)
    # The adapters really change the output: the experts are not the base.
    assert (
        composed_lora.component_logprobs(ids, mask)[1] - composed_lora.component_logprobs(ids, mask)[0]
    ).abs().max() > 1e-2


@pytest.mark.parametrize("implementation", ["stacked", "peft"])
def test_from_adapters_keeps_one_copy_of_the_base(implementation, tiny_config, lora_dirs):
    composed = ComposedLM.from_adapters(
        random_llama(tiny_config, seed=0),
        {k: str(v) for k, v in lora_dirs.items()},
        lora_implementation=implementation,
        pack_weights=True,  # (ignored by peft)
    )
    assert composed.backend.implementation == implementation
    model = composed.backend.model
    base_weights = [p for n, p in model.named_parameters() if "lora_" not in n]
    # The stacked path holds the linears' weights packed (few_row_linear.py): their parameters are empty meanwhile.
    held_packed = [m.__dict__[PACKED] for m in model.modules() if PACKED in m.__dict__]
    # Siblings (q/k/v, gate/up) share one packed tensor, which may hold the LoRA factors A too (extra rows).
    packs = list({id(p): p for p in (getattr(h, "group", h) for h in held_packed)}.values())
    packed = [pack.tensor for pack in packs]
    extra = sum(pack.extra[1] * pack.dense().shape[1] for pack in packs if getattr(pack, "extra", None))
    assert (implementation == "stacked") == bool(packed) == bool(extra)
    # One set of base weights (embedding + 2 layers + norm + head); LoRA factors are small.
    held = sum(p.numel() for p in base_weights) + sum(t.numel() for t in packed) - extra
    assert held == LlamaForCausalLM(tiny_config).num_parameters()
    lora_numel = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    if implementation == "stacked":
        lora_numel = sum(a.numel() + b.numel() for a, b in composed.backend.stacked.factors.values())
    assert 0 < lora_numel < 0.5 * held


def test_stacked_and_peft_mixed_batches_agree(composed_lora, tiny_config, lora_dirs):
    peft_path = ComposedLM.from_adapters(
        random_llama(tiny_config, seed=0), {k: str(v) for k, v in lora_dirs.items()}, lora_implementation="peft"
    )
    ids, mask = left_padded_batch([7, 2, 5], seed=10)
    torch.testing.assert_close(
        composed_lora.component_logprobs(ids, mask), peft_path.component_logprobs(ids, mask), atol=1e-5, rtol=0
    )
    assert torch.equal(
        composed_lora.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD),
        peft_path.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD),
    )


def test_stacked_hooks_are_inactive_outside_the_composition(composed_lora, base_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    # The shared base, called directly, is still the plain base model.
    torch.testing.assert_close(composed_lora.backend.model(ids).logits, base_model(ids).logits)


def test_from_adapters_accepts_peft_models(tiny_config, lora_dirs, composed_lora):
    peft_models = {
        name: PeftModel.from_pretrained(random_llama(tiny_config, seed=0), str(path))
        for name, path in lora_dirs.items()
    }
    composed = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), peft_models)
    ids, mask = left_padded_batch([5, 5], seed=4)
    torch.testing.assert_close(composed.logprobs(ids, mask), composed_lora.logprobs(ids, mask))


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("which", ["full", "lora"])
def test_cached_greedy_equals_naive_loop(
    which, composed_full, composed_lora, base_model, expert_models, tiny_config, lora_dirs
):
    ids, mask = left_padded_batch([4, 9, 6], seed=5)
    if which == "full":
        composed, models = composed_full, [base_model, *expert_models]
    else:
        composed = composed_lora
        models = [random_llama(tiny_config, seed=0)] + [
            merged_adapter_model(tiny_config, lora_dirs[n]) for n in ["ab", "cd"]
        ]
    generated = composed.generate(ids, mask, max_new_tokens=12, eos_token_id=EOS, pad_token_id=PAD)
    expected = naive_greedy(models, None, ids, mask, max_new_tokens=12)
    assert generated.shape[0] == 3 and generated.shape[1] > ids.shape[1]
    assert torch.equal(generated, expected)


def test_custom_positions_for_prompt_and_generated_tokens(composed_full, base_model, expert_models):
    # Every token at twice its index: prompt and generated positions given explicitly.
    ids, mask = left_padded_batch([4, 7], seed=11)
    prompt_positions = 2 * (mask.cumsum(-1) - 1).clamp(min=0)
    generated_positions = prompt_positions[:, -1:] + 2 * torch.arange(1, 9)
    out = composed_full.generate(
        ids,
        mask,
        max_new_tokens=8,
        eos_token_id=None,
        pad_token_id=PAD,
        position_ids=prompt_positions,
        generated_position_ids=generated_positions,
    )
    expected = naive_greedy([base_model, *expert_models], None, ids, mask, 8, eos=-1, stride=2)
    assert torch.equal(out, expected)
    assert not torch.equal(
        out, composed_full.generate(ids, mask, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD)
    )
    with pytest.raises(ValueError, match="generated_position_ids"):
        composed_full.generate(ids, mask, max_new_tokens=8, generated_position_ids=generated_positions[:, :3])


def test_rows_stop_at_eos_and_are_padded(composed_full):
    ids, mask = left_padded_batch([5, 8, 3], seed=6)
    free = composed_full.generate(ids, mask, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD)
    # Declare the first generated token of row 0 the EOS: row 0 must stop there, the others go on.
    eos = int(free[0, ids.shape[1]])
    stopped = composed_full.generate(ids, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD)
    assert stopped[0, ids.shape[1]] == eos
    assert (stopped[0, ids.shape[1] + 1 :] == PAD).all()
    for row in (1, 2):
        generated = free[row, ids.shape[1] :]
        hits = (generated == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else len(generated)
        assert torch.equal(stopped[row, ids.shape[1] : ids.shape[1] + end], generated[:end])


def test_sampling_is_reproducible_with_a_seed(composed_lora):
    ids, mask = left_padded_batch([6, 6], seed=7)
    kwargs = dict(
        max_new_tokens=15, do_sample=True, temperature=1.5, top_k=20, top_p=0.95, eos_token_id=None, pad_token_id=PAD
    )
    first = composed_lora.generate(ids, mask, seed=123, **kwargs)
    second = composed_lora.generate(ids, mask, seed=123, **kwargs)
    other = composed_lora.generate(ids, mask, seed=124, **kwargs)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_sampling_appends_the_same_token_to_every_component(tiny_config, lora_dirs):
    # Re-scoring the sampled sequence teacher-forced gives, at every generated position, the same
    # composed distribution the sampler saw; so it must assign the sampled token positive mass.
    composed = ComposedLM.from_adapters(random_llama(tiny_config, seed=0), {k: str(v) for k, v in lora_dirs.items()})
    ids, mask = left_padded_batch([4], seed=8)
    out = composed.generate(ids, mask, max_new_tokens=10, do_sample=True, top_k=3, seed=0, eos_token_id=None)
    logprobs = composed.logprobs(out)  # (1, T, V)
    prompt = ids.shape[1]
    chosen = logprobs[0, prompt - 1 : -1].gather(-1, out[0, prompt:, None]).squeeze(-1)
    top3 = logprobs[0, prompt - 1 : -1].topk(3, dim=-1).values[:, -1]
    assert (chosen >= top3 - 1e-5).all()


# ----------------------------------------------------------------------------- construction checks


def test_vocabulary_mismatch_names_both_sides(base_model):
    other = random_llama(tiny_llama_config(vocab_size=80), seed=3)
    with pytest.raises(ValueError, match=r"expert_models\[0\]` has 80 .* `base_model` has 64"):
        ComposedLM(base_model, [other])


def test_no_experts_and_bad_weights(base_model, expert_models):
    with pytest.raises(ValueError, match="at least one model"):
        ComposedLM(base_model, [])
    with pytest.raises(ValueError, match=r"one weight per expert \(2\), got 3"):
        ComposedLM(base_model, expert_models, weights=[1, 1, 1])


def test_tokenizer_mismatch(base_model, expert_models):
    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    same = {f"t{i}": i for i in range(64)}
    different = dict(same, t5=6, t6=5)
    ComposedLM(base_model, expert_models, tokenizers=[Vocab(same)] * 3)
    with pytest.raises(ValueError, match="tokenizer mismatch: the tokenizer of expert 1"):
        ComposedLM(base_model, expert_models, tokenizers=[Vocab(same), Vocab(same), Vocab(different)])


def test_adapter_for_another_base_is_refused(tmp_path, lora_dirs):
    wider = random_llama(tiny_llama_config(hidden_size=48), seed=0)
    with pytest.raises(ValueError, match=r"adapter `ab` was made for another base: .* has shape"):
        ComposedLM.from_adapters(wider, {"ab": str(lora_dirs["ab"])})


def test_bad_adapter_names_and_left_padding(tiny_config, lora_dirs, composed_full):
    with pytest.raises(ValueError, match="not allowed"):
        ComposedLM.from_adapters(random_llama(tiny_config, seed=0), {"__base__": str(lora_dirs["ab"])})
    ids, mask = left_padded_batch([3, 5])
    with pytest.raises(ValueError, match="left-padded"):
        composed_full.generate(ids, mask.flip(-1), max_new_tokens=2)


def test_nan_logits_raise(tiny_config):
    broken = random_llama(tiny_config, seed=5)
    with torch.no_grad():
        broken.lm_head.weight[3, 0] = float("nan")
    composed = ComposedLM(random_llama(tiny_config, seed=0), [broken])
    with pytest.raises(ValueError, match=r"component 'expert_0' produced NaN log-probs at row 0, position 0"):
        composed.logprobs(torch.tensor([[4, 5, 6]]))
    with pytest.raises(ValueError, match="NaN"):
        composed.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=2)


def test_lists_are_taken_as_tensors(composed_full):
    ids, mask = left_padded_batch([3, 5])
    # Close, not equal: while the few-row kernel is still timing its two kernels (kernels/few_row_kernel.py), two passes
    # over the same rows may run different kernels, whose float sums differ in the last bits.
    torch.testing.assert_close(composed_full.logprobs(ids.tolist(), mask.tolist()), composed_full.logprobs(ids, mask))
    assert torch.equal(
        composed_full.generate(ids.tolist(), mask.tolist(), max_new_tokens=3),
        composed_full.generate(ids, mask, max_new_tokens=3),
    )


def test_context_length_is_a_limit_not_a_truncation(composed_full):
    limit = composed_full.context_length  # 256: max_position_embeddings of the tiny config
    ids, mask = left_padded_batch([limit - 2, 4])
    composed_full.generate(ids, mask, max_new_tokens=2)  # the longest row plus 2 new tokens: exactly the limit
    with pytest.raises(ValueError, match=rf"needs {limit + 1} positions, beyond the model's context of {limit}"):
        composed_full.generate(ids, mask, max_new_tokens=3)
    composed_full.logprobs(torch.full((1, limit), 5))
    with pytest.raises(ValueError, match=rf"needs {limit + 1} positions"):
        composed_full.logprobs(torch.full((1, limit + 1), 5))


def test_truncate_keeps_the_newest_prompt_tokens_and_says_so(composed_full):
    limit = composed_full.context_length
    ids, mask = left_padded_batch([limit + 5, 10])  # row 0 is 5 + 3 tokens too long for 3 new tokens
    with pytest.warns(
        UserWarning, match=rf"cut the oldest tokens of 1 of 2 prompts \(up to 8 tokens\).*context of {limit}"
    ):
        out = composed_full.generate(ids, mask, max_new_tokens=3, eos_token_id=[], truncate=True)
    kept = limit - 3
    expected = composed_full.generate(ids[:, -kept:], mask[:, -kept:], max_new_tokens=3, eos_token_id=[])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        composed_full.generate(ids, mask, max_new_tokens=limit, truncate=True)
    with warnings.catch_warnings(record=True) as record:  # a prompt that fits is not touched, and not warned about
        warnings.simplefilter("always")
        fits = composed_full.generate(ids[1:, -10:], mask[1:, -10:], max_new_tokens=3, eos_token_id=[], truncate=True)
    assert not [w for w in record if "truncate" in str(w.message)]
    assert torch.equal(fits, composed_full.generate(ids[1:, -10:], mask[1:, -10:], max_new_tokens=3, eos_token_id=[]))


def test_sampling_settings_follow_transformers_warpers(composed_full):
    ids = torch.tensor([[4, 5, 6]])
    # Accepted as transformers' generate accepts them: top_k 0 and top_p 1 switch the filter off,
    # temperature 0 with greedy decoding means greedy.
    greedy = composed_full.generate(ids, max_new_tokens=3, eos_token_id=[])
    assert torch.equal(
        composed_full.generate(ids, max_new_tokens=3, eos_token_id=[], temperature=0.0, top_k=0, top_p=1.0), greedy
    )
    composed_full.generate(ids, max_new_tokens=2, do_sample=True, temperature=2, top_k=1, top_p=0.0, seed=0)
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number > 0, got 0.0 \(for greedy"):
        composed_full.generate(ids, max_new_tokens=2, do_sample=True, temperature=0.0)


def test_a_decoding_config_decodes_as_its_keyword_arguments(composed_full):
    ids, mask = left_padded_batch([5, 3], seed=21)
    options = dict(max_new_tokens=5, do_sample=True, temperature=1.3, top_k=20, seed=4, eos_token_id=EOS)
    config = DecodingConfig(**options)
    assert torch.equal(composed_full.generate(ids, mask, config=config), composed_full.generate(ids, mask, **options))
    # Keyword options replace the config's fields; one given at its default value replaces it too.
    shorter = composed_full.generate(ids, mask, config=config, max_new_tokens=2, pad_token_id=PAD)
    assert torch.equal(
        shorter, composed_full.generate(ids, mask, **{**options, "max_new_tokens": 2, "pad_token_id": PAD})
    )
    with pytest.raises(ValueError, match=r"`top_p` must be a number in \[0, 1\] \(1 or None: no nucleus filtering\)"):
        DecodingConfig(top_p=1.5)  # checked when built
    with pytest.raises(ValueError, match="`draft_lambda` needs a draft"):
        replace(config, draft_lambda=[1.0, 1.0])
    with pytest.raises(TypeError, match="`config` must be a DecodingConfig or None, got dict"):
        composed_full.generate(ids, mask, config=options)
    assert torch.equal(
        composed_full.generate(ids, mask, config=config, do_sample=False),
        composed_full.generate(ids, mask, **{**options, "do_sample": False}),
    )
    with pytest.raises(TypeError, match=r"unknown options \['max_tokens'\]; the decoding options .*'max_new_tokens'"):
        composed_full.generate(ids, mask, max_tokens=3)


def test_options_by_position_still_decode_with_a_deprecation_warning(composed_full):
    """The old form `generate(ids, mask, max_new_tokens, do_sample, temperature, top_k, top_p, eos, pad, seed,
    position_ids, generated_position_ids)` gives what the keywords give, for one release."""
    ids, mask = left_padded_batch([5, 3], seed=21)
    keywords = dict(max_new_tokens=4, do_sample=True, temperature=1.3, top_k=None, top_p=None, seed=2)
    expected = composed_full.generate(ids, mask, eos_token_id=[], pad_token_id=PAD, **keywords)
    with pytest.warns(DeprecationWarning, match="by position is deprecated .*`config=DecodingConfig"):
        old = composed_full.generate(ids, mask, 4, True, 1.3, None, None, [], PAD, 2)
    assert torch.equal(old, expected)
    positions = torch.arange(5).expand(2, 5)
    generated = torch.arange(5, 9).expand(2, 4)
    by_keyword = composed_full.generate(
        ids, mask, max_new_tokens=4, eos_token_id=[], position_ids=positions, generated_position_ids=generated
    )
    with pytest.warns(DeprecationWarning):
        by_position = composed_full.generate(ids, mask, 4, False, 1.0, None, None, [], None, None, positions, generated)
    assert torch.equal(by_position, by_keyword)
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"\['max_new_tokens'\] both by position"):
        composed_full.generate(ids, mask, 4, max_new_tokens=3)


class _Recorder(BaseStreamer):
    """transformers' streamer protocol, recording what it is given."""

    def __init__(self):
        self.put_values, self.ended = [], False

    def put(self, value):
        self.put_values.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("draft", [None, "merged"])
def test_a_streamer_gets_the_prompt_then_every_new_token(composed_full, draft):
    ids, mask = left_padded_batch([6], seed=5)
    options = dict(max_new_tokens=7, eos_token_id=[])
    if draft is not None:
        options.update(draft=draft, num_draft_tokens=3, adaptive_draft=False)
    expected = composed_full.generate(ids, mask, **options)
    recorder = _Recorder()
    streamed = composed_full.generate(ids, mask, streamer=recorder, **options)
    assert torch.equal(streamed, expected) and recorder.ended
    assert recorder.put_values[0] == ids.tolist()  # the prompt first, as transformers' generate puts it
    tokens = [token for value in recorder.put_values[1:] for token in value]
    assert tokens == expected[0, ids.shape[1] :].tolist()
    text = TextStreamer(_DigitsTokenizer(), skip_prompt=True)  # transformers' own streamer runs on it
    composed_full.generate(ids, mask, streamer=text, **options)
    pairs = left_padded_batch([6, 4], seed=5)
    with pytest.raises(ValueError, match="`streamer` streams one row: a batch of 1 prompt, got 2"):
        composed_full.generate(*pairs, streamer=_Recorder(), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"`streamer` must have put\(\) and end\(\)"):
        composed_full.generate(ids, mask, streamer=object(), max_new_tokens=2)


class _DigitsTokenizer:
    """What `TextStreamer` asks of a tokenizer: `decode`."""

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))


# ----------------------------------------------------------------------------- from_pretrained


def test_from_pretrained_tells_adapters_from_checkpoints(
    tmp_path, tiny_config, lora_dirs, expert_models, composed_lora
):
    base_dir = tmp_path / "base"
    random_llama(tiny_config, seed=0).save_pretrained(base_dir)
    ids, mask = left_padded_batch([5, 3], seed=9)

    adapters_only = ComposedLM.from_pretrained(base_dir, [lora_dirs["ab"], lora_dirs["cd"]])
    assert type(adapters_only.backend).__name__ == "SharedAdapters"
    torch.testing.assert_close(adapters_only.logprobs(ids, mask), composed_lora.logprobs(ids, mask), atol=1e-5, rtol=0)

    full_dir = tmp_path / "full"
    expert_models[0].save_pretrained(full_dir)
    mixed = ComposedLM.from_pretrained(base_dir, [full_dir, lora_dirs["cd"]])
    assert type(mixed.backend).__name__ == "SeparateModels"
    reference = ComposedLM(
        random_llama(tiny_config, seed=0), [expert_models[0], merged_adapter_model(tiny_config, lora_dirs["cd"])]
    )
    torch.testing.assert_close(mixed.logprobs(ids, mask), reference.logprobs(ids, mask), atol=1e-5, rtol=0)


def test_from_pretrained_takes_names(tmp_path, tiny_config, lora_dirs, expert_models):
    base_dir, full_dir = tmp_path / "base", tmp_path / "full"
    random_llama(tiny_config, seed=0).save_pretrained(base_dir)
    expert_models[0].save_pretrained(full_dir)
    adapters_only = ComposedLM.from_pretrained(base_dir, [lora_dirs["ab"], lora_dirs["cd"]], names=["math", "code"])
    assert adapters_only.expert_names == ["math", "code"]
    assert adapters_only.backend.components == ["__base__", "math", "code"]
    mixed = ComposedLM.from_pretrained(base_dir, [full_dir, lora_dirs["cd"]], names=["full", "lora"])
    assert mixed.expert_names == ["full", "lora"]
    assert ComposedLM.from_pretrained(base_dir, [full_dir, lora_dirs["cd"]]).expert_names == ["full", "cd"]
    with pytest.raises(ValueError, match=r"`names` must hold one name per expert \(2\), got 1"):
        ComposedLM.from_pretrained(base_dir, [full_dir, lora_dirs["cd"]], names=["full"])
    with pytest.raises(ValueError, match="adapter name 'a b' is not allowed"):
        ComposedLM.from_pretrained(base_dir, [lora_dirs["ab"], lora_dirs["cd"]], names=["a b", "c"])


# ----------------------------------------------------------------------------- names


def test_names_default_and_given(base_model, expert_models, tiny_config, lora_dirs):
    assert ComposedLM(base_model, expert_models).expert_names == ["expert_0", "expert_1"]
    assert ComposedLM(base_model, expert_models, names=("math", "code")).expert_names == ["math", "code"]
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    with ComposedLM.from_adapters(random_llama(tiny_config, seed=0), adapters, names=["ab", "cd"]) as composed:
        assert composed.expert_names == ["ab", "cd"]


@pytest.mark.parametrize(
    "names, message",
    [
        (["math"], r"`names` must hold one name per expert \(2\), got 1: \['math'\]"),
        (["math", "math"], r"`names` must be unique, got \['math'\] more than once"),
        (["math", ""], r"`names` must be non-empty strings, got '' in \['math', ''\]"),
        (["math", 3], r"`names` must be non-empty strings, got 3 in"),
        ("mc", r"`names` must be a list or tuple of 2 expert names, got 'mc'"),
    ],
)
def test_bad_names_are_refused(names, message, base_model, expert_models):
    with pytest.raises(ValueError, match=message):
        ComposedLM(base_model, expert_models, names=names)


def test_from_adapters_names_must_equal_the_keys(tiny_config, lora_dirs):
    base = random_llama(tiny_config, seed=0)
    before = module_tree(base)
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    refused = r"`names` must be left out or equal the keys of `adapters` in order, \['ab', 'cd'\], got \['cd', 'ab'\]"
    with pytest.raises(ValueError, match=refused):
        ComposedLM.from_adapters(base, adapters, names=["cd", "ab"])
    with pytest.raises(ValueError, match=r"`names` must be unique"):
        ComposedLM.from_adapters(base, adapters, names=["ab", "ab"])
    assert module_tree(base) == before  # refused before the base model was touched


# ----------------------------------------------------------------------------- close()


def module_tree(model):
    """Every module with its path, identity, type, mode, instance-level forward and hooks."""
    return [
        (
            path,
            module,
            type(module),
            module.training,
            "forward" in module.__dict__,
            len(module._forward_hooks),
            len(module._forward_pre_hooks),
        )
        for path, module in model.named_modules()
    ]


def parameters_state(model):
    state = {key: value.clone() for key, value in model.state_dict().items()}
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    return state, requires_grad


def assert_same_parameters(model, expected):
    state, requires_grad = parameters_state(model)
    assert list(state) == list(expected[0])
    assert all(torch.equal(state[key], expected[0][key]) for key in state)
    assert requires_grad == expected[1]


@torch.no_grad()
def plain_logits(model):
    ids, mask = left_padded_batch([6, 3], seed=13)
    return model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)


def caller_base(tiny_config):
    """A base model in a state peft would change: train mode but an eval head, a frozen embedding."""
    base = random_llama(tiny_config, seed=0).train()
    base.lm_head.eval()
    base.model.embed_tokens.weight.requires_grad_(False)
    return base


@pytest.mark.parametrize("implementation", ["stacked", "peft"])
def test_close_gives_the_base_model_back(implementation, tiny_config, lora_dirs):
    base = caller_base(tiny_config)
    tree, parameters, logits = module_tree(base), parameters_state(base), plain_logits(base)
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    ids, mask = left_padded_batch([5, 4], seed=14)

    composed = ComposedLM.from_adapters(base, adapters, lora_implementation=implementation)
    assert composed.backend.implementation == implementation
    composed_logprobs = composed.logprobs(ids, mask)
    assert module_tree(base) != tree  # the composition did change the caller's model
    composed.close()
    assert module_tree(base) == tree
    assert_same_parameters(base, parameters)
    assert torch.equal(plain_logits(base), logits)
    composed.close()  # idempotent
    assert module_tree(base) == tree

    # The base model is still usable: composing it again gives the same numbers, and a `with`
    # block gives it back too, also when the block raises.
    with pytest.raises(KeyError):
        with ComposedLM.from_adapters(base, adapters, lora_implementation=implementation) as again:
            assert torch.equal(again.logprobs(ids, mask), composed_logprobs)
            raise KeyError("leaving the block")
    assert module_tree(base) == tree
    assert_same_parameters(base, parameters)
    assert torch.equal(plain_logits(base), logits)

    for use in (
        lambda: composed.logprobs(ids, mask),
        lambda: again.generate(ids, mask, max_new_tokens=2),
        lambda: again.__enter__(),
    ):
        with pytest.raises(RuntimeError, match="this ComposedLM was closed"):
            use()


def test_close_on_full_checkpoints_leaves_the_models_alone(tiny_config):
    base, expert = random_llama(tiny_config, seed=0), random_llama(tiny_config, seed=1)
    trees, parameters = [module_tree(m) for m in (base, expert)], [parameters_state(m) for m in (base, expert)]
    with ComposedLM(base, [expert]) as composed:
        composed.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=2)
    assert [module_tree(m) for m in (base, expert)] == trees
    for model, expected in zip((base, expert), parameters):
        assert_same_parameters(model, expected)
    composed.close()
    with pytest.raises(RuntimeError, match="this ComposedLM was closed"):
        composed.component_logprobs(torch.tensor([[4, 5, 6]]))


def test_failed_from_adapters_leaves_the_base_as_it_was(tmp_path, tiny_config, lora_dirs):
    base = caller_base(tiny_config)
    tree, parameters = module_tree(base), parameters_state(base)
    wide = random_lora_adapter(random_llama(tiny_llama_config(hidden_size=48), seed=0), tmp_path / "wide", seed=3)
    # The second adapter fails after the first was injected.
    with pytest.raises(ValueError, match="adapter `wide` was made for another base"):
        ComposedLM.from_adapters(base, {"ab": str(lora_dirs["ab"]), "wide": str(wide)})
    assert module_tree(base) == tree
    assert_same_parameters(base, parameters)
    adapters = {k: str(v) for k, v in lora_dirs.items()}
    with pytest.raises(ValueError, match=r"one weight per expert \(2\), got 3"):
        ComposedLM.from_adapters(base, adapters, weights=[1, 1, 1])
    with pytest.raises(ValueError, match="`lora_implementation` must be one of"):
        ComposedLM.from_adapters(base, adapters, lora_implementation="fast")
    assert module_tree(base) == tree


def test_a_model_that_caps_attention_logits_is_loaded_with_eager_attention(tmp_path):
    """Gemma-2 soft-caps attention logits; some transformers versions load it with SDPA, which skips the cap."""
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        attn_logit_softcapping=5.0,
    )
    for name, seed in [("base", 0), ("expert", 1)]:
        torch.manual_seed(seed)
        Gemma2ForCausalLM(config).save_pretrained(tmp_path / name)
    composed = ComposedLM.from_pretrained(tmp_path / "base", [tmp_path / "expert"])
    assert [model.config._attn_implementation for model in composed.backend.models] == ["eager", "eager"]
    # The caller's choice stands: SDPA is used, or refused by transformers itself (5.24 refuses it for Gemma-2).
    try:
        chosen = ComposedLM.from_pretrained(tmp_path / "base", [tmp_path / "expert"], attn_implementation="sdpa")
    except ValueError as error:
        assert "scaled_dot_product_attention" in str(error)
    else:
        assert chosen.base_model.config._attn_implementation == "sdpa"
