"""A user's own remedy (`tests/extensions/user_remedies.py`, outside the package) through the remedy protocol:
its phase on hand-computed numbers, `ComposedLM.generate` with and without a draft, `mergecompose generate`, a
config's `class:` entry and its fingerprint, lm-eval's string form, and the refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from user_remedies import BaseTopK, LogitsPhase, NoMethod, Scale

from mergecompose.cli import main
from mergecompose.composition import ComposedLM, RemedySettings, compose_logprobs, compose_with_remedies
from mergecompose.composition.remedies import ActivityGate, check_remedies
from mergecompose.composition.remedy_phases import PHASES, remedy_phase
from mergecompose.core.tiny import EOS, PAD, left_padded_batch
from mergecompose.experiments.compare_config import fingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_mask_remedy_of_ones_own_keeps_the_bases_top_k_by_hand():
    """V = 4; base log-probs favour tokens 0 and 1, so BaseTopK(2) keeps them and renormalises the composition."""
    base = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    expert = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    components = torch.stack([base, expert])  # (2, 4): one expert at weight 1 composes to itself
    composed = compose_with_remedies(components, remedies=[BaseTopK(2)])
    # The expert alone, restricted to {0, 1}: 0.1 / 0.3 and 0.2 / 0.3.
    expected = torch.tensor([math.log(1 / 3), math.log(2 / 3), -math.inf, -math.inf])
    torch.testing.assert_close(composed, expected)


def test_an_exponent_remedy_of_ones_own_multiplies_the_weights():
    """Scale(alpha) in the exponent phase is the rule at weights alpha · w; with a built-in gate it comes after it."""
    components = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))  # (k+1, P, V)
    composed = compose_with_remedies(components, [1.0, 2.0], remedies=[Scale(0.25)])
    expected = compose_logprobs(components[0], list(components[1:]), [0.25, 0.5])
    torch.testing.assert_close(composed, expected)
    gated = compose_with_remedies(components, remedies=[Scale(0.5), ActivityGate(0.5)])
    active = ActivityGate(0.5).active(torch.log_softmax(components, -1)).float()  # (k, P)
    torch.testing.assert_close(gated, compose_logprobs(components[0], list(components[1:]), 0.5 * active))


def test_phases_are_declared_and_checked():
    assert [remedy_phase(remedy) for remedy in (Scale(), BaseTopK())] == ["exponent", "mask"]
    assert PHASES == ("exponent", "score", "mask", "termination")
    with pytest.raises(ValueError, match=r"unknown remedy .*LogitsPhase declares phase 'logits', which is not one"):
        check_remedies([LogitsPhase()], 8)
    with pytest.raises(ValueError, match=r"NoMethod declares phase 'mask' but has no method `allowed`"):
        check_remedies([NoMethod()], 8)
    with pytest.raises(ValueError, match=r"an instance, got the class BaseTopK"):
        remedy_phase(BaseTopK)


def test_a_user_remedy_under_speculative_decoding_is_exact(base_model, expert_models):
    """Greedy with a draft gives plain greedy's tokens, and every token is one of the base's top 2 where it was
    chosen (what the mask says); without the remedy the composition leaves them."""
    lm = ComposedLM(base_model, expert_models, remedies=[BaseTopK(2)])
    ids, mask = left_padded_batch([4, 6, 6], seed=9)
    kwargs = {"max_new_tokens": 12, "eos_token_id": EOS, "pad_token_id": PAD}
    plain = lm.generate(ids, mask, **kwargs)
    speculative = lm.generate(ids, mask, draft="merged", num_draft_tokens=3, adaptive_draft=False, **kwargs)
    assert torch.equal(plain, speculative)
    assert lm.speculation_stats.tested > 0
    free = ComposedLM(base_model, expert_models).generate(ids, mask, **kwargs)
    assert _outside_base_top(base_model, plain, mask, ids.shape[1], 2) == 0
    assert _outside_base_top(base_model, free, mask, ids.shape[1], 2) > 0


def _outside_base_top(model, output, mask, prompt_length, k) -> int:
    """How many generated tokens (before EOS and padding) are outside the base's top k at their position."""
    full_mask = torch.cat([mask, torch.ones_like(output[:, prompt_length:])], dim=1)
    with torch.no_grad():
        logits = model(output, attention_mask=full_mask).logits  # (B, T, V)
    outside = 0
    for row in range(output.shape[0]):
        for position in range(prompt_length, output.shape[1]):
            token = int(output[row, position])
            if token in (EOS, PAD):
                break
            top = logits[row, position - 1].topk(k).indices.tolist()
            outside += token not in top
    return outside


def test_generate_with_a_remedy_of_ones_own(smollm2_dir, smollm2_adapters, tmp_path, capsys):
    """`--remedy "{class: user_remedies:BaseTopK, k: 1}"` keeps only the base's top token: the base's greedy text."""
    prompt, out = "Name a colour.", tmp_path / "answers.jsonl"
    argv = ["generate", prompt, "--base", str(smollm2_dir), "--expert", str(smollm2_adapters["math"])]
    argv += ["--expert", str(smollm2_adapters["code"]), "--max-new-tokens", "8", "--out", str(out), "--quiet"]
    assert main([*argv, "--remedy", "{class: user_remedies:BaseTopK, k: 1}"]) == 0
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    greedy = base.generate(ids, max_new_tokens=8, do_sample=False)
    assert record["text"] == tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True)
    assert record["settings"]["remedy"]["custom"][0]["class"] == "user_remedies:BaseTopK"
    assert record["settings"]["remedy"]["custom"][0]["k"] == 1


def test_a_config_entry_names_its_class_and_its_fingerprint_follows_the_code(tmp_path, monkeypatch):
    """`{class: PATH, ...}` validates to the remedy; a dump carries the module's hash, so a fingerprint of the config
    changes when the user's code does, and the dump validates back to the same settings."""
    module = tmp_path / "remedy_under_edit.py"  # a name no other test imports (the modules are cached)
    module.write_text(_module_text("0.5"))
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = RemedySettings.model_validate({"class": "remedy_under_edit:Half", "alpha": 0.25})
    (remedy,) = settings.build(eos_token_id=3)
    assert type(remedy).__name__ == "Half" and remedy.alpha == 0.25 and remedy.eos == 3  # eos_token_id filled in
    before = fingerprint(settings)
    dumped = settings.model_dump(mode="json")
    assert RemedySettings.model_validate(dumped) == settings
    module.write_text(_module_text("0.75"))
    assert fingerprint(settings) != before
    assert fingerprint(RemedySettings(gate=0.1)) == fingerprint({"gate": 0.1, **_defaults()})  # built-ins: as before


def _module_text(default: str) -> str:
    return (
        "from typing import ClassVar\n"
        "import torch\n"
        "class Half:\n"
        "    phase: ClassVar[str] = 'exponent'\n"
        f"    def __init__(self, alpha={default}, eos_token_id=None):\n"
        "        self.alpha, self.eos = alpha, eos_token_id\n"
        "    def multipliers(self, components):\n"
        "        return torch.full(components.shape[:-1], self.alpha)[1:]\n"
    )


def _defaults() -> dict:
    return {
        "plausibility_alpha": None,
        "plausibility_top_p": None,
        "termination": None,
        "termination_threshold": 0.1,
    }


def test_lm_evals_string_form_names_a_class_and_its_parameters():
    settings = RemedySettings.parse("gate:0.1;class:user_remedies:Scale;alpha:0.25")
    assert settings.gate == 0.1
    gate, scale = settings.build(eos_token_id=0)
    assert isinstance(gate, ActivityGate) and isinstance(scale, Scale) and scale.alpha == 0.25  # read as YAML: 0.25
    with pytest.raises(ValueError, match=r"`remedies` .*takes no parameter 'beta'; it takes \['alpha'\]"):
        RemedySettings.parse("class:user_remedies:Scale;beta:1")
