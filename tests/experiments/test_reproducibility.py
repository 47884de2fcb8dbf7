"""Same seed, same numbers: initial weights, training batches and evaluation strings are pinned by hash.

The digests were computed with the code as it stood before the task types moved into their own
folders and the samplers, string streams and trainers were unified; they must not change, so
that cached checkpoints and every README figure stay valid. (Initial weights depend on torch's
generator: the digests are those of the pinned CPU build, torch 2.13.)
"""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest
import torch

from mergecompose.experiments.compare_config import load_config
from mergecompose.experiments.models import build_model, lora_config
from mergecompose.experiments.tokenizer import build_tokenizer
from mergecompose.experiments.trained_models import derived_seed, new_adapter, sequence_format

PINNED = {
    "configs/letters.yaml": {
        "weights": "53bc7ad81c666615",
        "batches:None": "0779672192b737a8",
        "batches:ab": "1d8429e49c1ec231",
        "eval_data": "88a7faebe60127c8",
    },
    "configs/skills_k3_test.yaml": {
        "weights": "60d1d3d1d0ba6961",
        "batches:None": "2589e763936d1170",
        "batches:shift": "ba1ff8a84e2d277b",
        "eval_data": "812a65e43de217d7",
    },
    "configs/letters_paper.yaml": {
        "weights": "52d7ee4d26622af3",
        "batches:None": "cb29081c95aaba38",
        "batches:ab": "dc321aec89cddce5",
        "eval_data": "05104db12a415fa7",
    },
}


def _digest_tensors(tensors) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def digests(path: str) -> dict[str, str]:
    """Digests of the base's initial weights, the first 3 training batches (base, first expert) and every eval
    string."""
    config = load_config(path)
    tokenizer = build_tokenizer(config.task.alphabet)
    fmt = sequence_format(config, tokenizer)
    seed = config.training.seed
    model = build_model(
        config.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, derived_seed(seed, "base")
    )
    found = {"weights": _digest_tensors(model.state_dict().values())}
    skill = config.task.joint[0]
    for name, settings, labels in [
        (None, config.training.base, ("base",)),
        (skill, config.training.experts.full, ("expert", skill)),
    ]:
        stream = config.task.training_strings(name, tokenizer, fmt, settings, derived_seed(seed, "data", *labels))
        batches = list(itertools.islice(iter(stream), 3))
        found[f"batches:{name}"] = _digest_tensors(
            [t for batch in batches for t in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.labels)]
        )
    data = config.task.eval_data(config.evaluation, config.eval_length, config.task.train_lengths[1])
    sets = {
        "test": data.test,
        "validation": data.validation,
        **{f"curve:{kind}": sets for kind, sets in data.curves.items()},
    }
    text = json.dumps(
        {kind: {str(key): [s.sources, s.targets] for key, s in group.items()} for kind, group in sets.items()},
        sort_keys=True,
    )
    found["eval_data"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return found


@pytest.mark.parametrize("path", sorted(PINNED))
def test_seeded_weights_batches_and_eval_strings_are_unchanged(path):
    assert digests(path) == PINNED[path]


def test_the_digest_sees_a_changed_seed():
    config = load_config("configs/letters.yaml")
    tokenizer = build_tokenizer(config.task.alphabet)
    fmt = sequence_format(config, tokenizer)
    first = next(iter(config.task.training_strings(None, tokenizer, fmt, config.training.base, seed=1)))
    second = next(iter(config.task.training_strings(None, tokenizer, fmt, config.training.base, seed=2)))
    assert _digest_tensors([first.input_ids]) != _digest_tensors([second.input_ids])


def test_an_adapter_s_initial_weights_depend_on_its_seed_alone():
    # A sweep trains k = 4's adapters after k = 2's evaluation: the global generator is then elsewhere.
    config = load_config("configs/letters.yaml")
    tokenizer = build_tokenizer(config.task.alphabet)
    lora = lora_config(config.training.experts.lora_for("ab"), config.model.architecture)

    def initial_adapter(global_seed: int, seed: int) -> dict:
        base = build_model(config.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
        torch.manual_seed(global_seed)
        before = torch.random.get_rng_state()
        adapter = new_adapter(base, lora, seed)
        assert torch.equal(torch.random.get_rng_state(), before)  # the global generator is left as it was
        return {key: value.clone() for key, value in adapter.state_dict().items() if "lora_" in key}

    first, second, other = initial_adapter(1, 7), initial_adapter(2, 7), initial_adapter(1, 8)
    assert first and first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)
