"""Bad input to composition: the rule, `ComposedLM` (scoring and generation), remedies, lm-eval's model."""

from __future__ import annotations

import math

import torch

from bad_inputs import Api, Case
from mergecompose.composition import ComposedLM, compose_logprobs
from mergecompose.composition.remedies import ActivityGate, RemedySettings, TerminationRule, compose_with_remedies

INF, NAN = math.inf, math.nan


def _logits(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def _composed(env) -> ComposedLM:
    """The shared base composed with itself: full models are used as given, nothing is changed."""
    return ComposedLM(env.base_model, [env.base_model])


def _prompt(length: int = 3) -> torch.Tensor:
    return torch.arange(4, 4 + length)[None] % 60


def _generate(**kwargs):
    def build(env):
        options = {"max_new_tokens": 2, "eos_token_id": []} | kwargs
        return Api(lambda: _composed(env).generate(options.pop("input_ids", _prompt()), **options))

    return build


def _score(input_ids, **kwargs):
    return lambda env: Api(lambda: _composed(env).logprobs(input_ids() if callable(input_ids) else input_ids, **kwargs))


def rule_with(base=None, experts=None, **kwargs):
    def build(env):
        x = _logits(2, 3, 8)
        return Api(
            lambda: compose_logprobs(
                x if base is None else base(x), [x, x] if experts is None else experts(x), **kwargs
            )
        )

    return build


def _with_plus_inf(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 2, 5] = INF
    return x


def _per_position_weights_with_nan() -> torch.Tensor:
    weights = torch.ones(2, 2, 3)  # (k, B, T) for base (B, T, V) = (2, 3, 8)
    weights[1, 0, 0] = NAN
    return weights


def remedies_plus_inf(env):
    components = _with_plus_inf(_logits(3, 2, 3, 8)[0]).expand(3, 2, 3, 8)
    return Api(lambda: compose_with_remedies(components, [1.0, 1.0], [ActivityGate(0.1)]))


def termination_eos_beyond_vocab(env):
    return Api(lambda: compose_with_remedies(_logits(3, 2, 8), remedies=[TerminationRule(99)]))


def lm_eval_chunk_not_a_number(env):
    from mergecompose.integrations.lm_eval.harness_model import ComposedHFLM

    return Api(
        lambda: ComposedHFLM(str(env.checkpoints / "base"), str(env.checkpoints / "expert_0"), chunk_megabytes="lots")
    )


CASES = [
    # non-finite numbers
    Case(
        "rule-weights-inf", "silent", rule_with(weights=[INF, 1.0]), r"`weights\[0\]` must be a finite number, got inf"
    ),
    Case(
        "rule-weights-nan-per-position",
        "silent",
        rule_with(weights=_per_position_weights_with_nan()),
        r"`weights` must be finite, got nan at index \(1, 0, 0\)",
    ),
    Case(
        "rule-plus-inf-logit", "silent", rule_with(base=_with_plus_inf), r"`base` contains \+inf at index \(1, 2, 5\)"
    ),
    Case(
        "rule-plus-inf-expert",
        "silent",
        rule_with(experts=lambda x: [x, _with_plus_inf(x)]),
        r"`experts\[1\]` contains \+inf",
    ),
    Case("rule-floor-nan", "silent", rule_with(floor=NAN), r"`floor` must be a finite negative number.*got nan"),
    Case("remedies-plus-inf-logit", "silent", remedies_plus_inf, r"`components`.*contains \+inf at index"),
    Case(
        "composed-weights-inf",
        "silent",
        lambda env: Api(lambda: ComposedLM(env.base_model, [env.base_model], [INF])),
        r"`weights\[0\]` must be a finite number, got inf",
    ),
    Case(
        "composed-weights-nan",
        "silent",
        lambda env: Api(lambda: ComposedLM(env.base_model, [env.base_model], [NAN])),
        r"`weights\[0\]` must be a finite number, got nan",
    ),
    Case(
        "composed-weights-text",
        "traceback",
        lambda env: Api(lambda: ComposedLM(env.base_model, [env.base_model], ["heavy"])),
        r"`weights\[0\]` must be a number, got 'heavy'",
    ),
    Case(
        "remedy-termination-threshold-nan",
        "silent",
        lambda env: Api(lambda: TerminationRule(2, "active", threshold=NAN)),
        r"`threshold` must be >= 0 and finite.*nan",
    ),
    Case(
        "remedy-gate-inf",
        "silent",
        lambda env: Api(lambda: ActivityGate(INF)),
        r"`threshold` must be >= 0 and finite.*inf",
    ),
    Case(
        "remedy-settings-gate-inf", "silent", lambda env: Api(lambda: RemedySettings.parse("gate:inf")), r"gate.*finite"
    ),
    Case(
        "remedy-termination-eos-beyond-vocab",
        "traceback",
        termination_eos_beyond_vocab,
        r"`TerminationRule.eos_token_id` must be below the vocabulary size 8, got 99",
    ),
    # shapes and types
    Case(
        "rule-per-position-weights-wrong-shape",
        "traceback",
        rule_with(weights=torch.ones(2, 5, 3)),
        r"`weights` of shape \(2, 5, 3\) must be .* leading dims of `base` \(2, 3\)",
    ),
    Case(
        "rule-base-a-list",
        "traceback",
        rule_with(base=lambda x: x.tolist()),
        r"`base` must be a torch\.Tensor.*got list",
    ),
    Case(
        "rule-experts-a-tensor",
        "traceback",
        rule_with(experts=lambda x: x),
        r"`experts` must be a list of tensors, got Tensor",
    ),
    # sampling arguments (transformers' warper rules)
    Case(
        "generate-top-p-above-one",
        "silent",
        _generate(do_sample=True, top_p=1.5),
        r"`top_p` must be a number in \[0, 1\].*got 1\.5",
    ),
    Case(
        "generate-top-p-nan",
        "silent",
        _generate(do_sample=True, top_p=NAN),
        r"`top_p` must be a number in \[0, 1\].*got nan",
    ),
    Case(
        "generate-top-k-negative",
        "silent",
        _generate(do_sample=True, top_k=-3),
        r"`top_k` must be an integer >= 1.*got -3",
    ),
    Case(
        "generate-temperature-inf",
        "silent",
        _generate(do_sample=True, temperature=INF),
        r"`temperature` must be a finite number > 0, got inf",
    ),
    Case(
        "generate-temperature-nan-greedy",
        "silent",
        _generate(temperature=NAN),
        r"`temperature` must be a finite number > 0, got nan",
    ),
    Case(
        "generate-max-new-tokens-fraction",
        "traceback",
        _generate(max_new_tokens=2.5),
        r"`max_new_tokens` must be >= 1, got 2\.5",
    ),
    Case("generate-pad-negative", "traceback", _generate(pad_token_id=-7), r"`pad_token_id`.*\[0, 64\), got -7"),
    Case("generate-pad-beyond-vocab", "traceback", _generate(pad_token_id=64), r"`pad_token_id`.*\[0, 64\), got 64"),
    Case(
        "generate-eos-beyond-vocab",
        "silent",
        _generate(eos_token_id=[2, 100]),
        r"`eos_token_id`.*\[0, 64\).*got \[2, 100\]",
    ),
    Case("generate-seed-fraction", "traceback", _generate(do_sample=True, seed=1.5), r"`seed` must be an integer"),
    # inputs
    Case(
        "score-token-id-beyond-vocab",
        "traceback",
        _score(torch.tensor([[5, 64]])),
        r"`input_ids` must be token ids in \[0, 64\).*got 64",
    ),
    Case(
        "score-token-id-negative",
        "traceback",
        _score(torch.tensor([[5, -1]])),
        r"`input_ids` must be token ids in \[0, 64\).*got -1",
    ),
    Case(
        "score-float-input-ids",
        "traceback",
        _score(torch.tensor([[5.0, 6.0]])),
        r"`input_ids` must hold integer token ids, got dtype torch.float32",
    ),
    Case(
        "score-input-ids-a-string",
        "traceback",
        _score("hello"),
        r"`input_ids` must be a \(batch, seq\) torch\.Tensor.*got str",
    ),
    Case(
        "score-input-ids-ragged-list",
        "traceback",
        _score([[5, 6, 7], [5]]),
        r"`input_ids` must be .*list of equal-length lists",
    ),
    Case(
        "score-mask-wrong-shape",
        "traceback",
        _score(torch.tensor([[5, 6]]), attention_mask=torch.ones(1, 3)),
        r"`attention_mask` must have the shape of `input_ids` \(1, 2\), got \(1, 3\)",
    ),
    Case(
        "generate-mask-half",
        "misleading",
        _generate(attention_mask=torch.full((1, 3), 0.5)),
        r"`attention_mask` must hold only 0 and 1.*got 0\.5",
    ),
    Case(
        "score-mask-two",
        "silent",
        _score(torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1, 2]])),
        r"`attention_mask` must hold only 0 and 1.*got 2",
    ),
    # context length
    Case(
        "generate-prompt-beyond-context",
        "silent",
        _generate(input_ids=_prompt(250), max_new_tokens=10),
        r"prompt \(250 tokens a row\) plus `max_new_tokens`=10 needs 260 positions, beyond the model's context of 256",
    ),
    Case(
        "score-beyond-context",
        "silent",
        _score(lambda: torch.full((1, 300), 5)),
        r"300 tokens.* needs 300 positions, beyond the model's context of 256",
    ),
    # lm-eval's string model_args
    Case(
        "lm-eval-chunk-megabytes-not-a-number",
        "traceback",
        lm_eval_chunk_not_a_number,
        r"`chunk_megabytes` must be a positive integer.*got .lots.",
    ),
]


# speculative decoding (`generate(draft=...)`)
from mergecompose.analysis.data import char_tokenizer  # noqa: E402 - rows appended below the table above
from mergecompose.core.tiny import random_llama, tiny_llama_config  # noqa: E402


def _speculate(draft=None, composed=_composed, **kwargs):
    def build(env):
        options = {"max_new_tokens": 2, "eos_token_id": [], "draft": draft(env) if callable(draft) else draft} | kwargs
        return Api(lambda: composed(env).generate(_prompt(), **options))

    return build


def _with_tokenizer(env) -> ComposedLM:
    return ComposedLM(env.base_model, [env.base_model], tokenizers=char_tokenizer(_CHARACTERS))


def _other_vocabulary(env):
    return random_llama(tiny_llama_config(vocab_size=80), seed=3)


_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234567"  # 60 + 4 special tokens = 64 ids

CASES += [
    Case(
        "generate-draft-other-vocabulary",
        "clear",
        _speculate(_other_vocabulary),
        r"`draft` must have the composition's vocabulary of 64 tokens, got a model with 80",
    ),
    Case(
        "generate-draft-tokens-zero",
        "clear",
        _speculate("merged", num_draft_tokens=0),
        r"`num_draft_tokens` must be an integer >= 1.*got 0",
    ),
    Case(
        "generate-draft-tokens-negative",
        "clear",
        _speculate("merged", num_draft_tokens=-3),
        r"`num_draft_tokens` must be an integer >= 1.*got -3",
    ),
    Case(
        "generate-draft-on-another-device",
        "clear",
        _speculate(lambda env: random_llama(env.tiny_config, 0).to("meta")),
        r"`draft` must be on the composition's device cpu, got a model on meta",
    ),
    Case(
        "generate-draft-other-tokenizer",
        "clear",
        _speculate(lambda env: env.base_model, _with_tokenizer, draft_tokenizer=char_tokenizer(_CHARACTERS[::-1])),
        r"`draft_tokenizer` must be the composition's tokenizer, got one that differs: 64 tokens against 64",
    ),
    Case(
        "generate-draft-unknown-name",
        "clear",
        _speculate("merge"),
        r"`draft` must be None, 'merged' or a causal LM.*got 'merge'",
    ),
    Case(
        "generate-draft-lambda-wrong-length",
        "clear",
        _speculate("merged", draft_lambda=[1.0, 2.0]),
        r"`draft_lambda` must hold one finite λ_i per expert \(1\), got \[1\.0, 2\.0\]",
    ),
    Case(
        "generate-draft-tokens-without-draft",
        "clear",
        _speculate(None, num_draft_tokens=3),
        r"`num_draft_tokens` needs a draft",
    ),
]
