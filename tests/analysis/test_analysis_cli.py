"""`mergecompose overlap` end to end on tiny checkpoints and adapters saved locally, with a char tokenizer."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from mergecompose.analysis.data import Record, char_tokenizer, encode_records, make_batches, read_jsonl
from mergecompose.analysis.own_prompts import OWN_PROMPT_STATISTICS, own_prompt_statistics
from mergecompose.cli import main
from mergecompose.core.tiny import random_lora_adapter
from mergecompose.merging import merge

CHARACTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ >"


def _lm_head_expert(base, seed):
    torch.manual_seed(seed)
    expert = copy.deepcopy(base)
    with torch.no_grad():
        expert.lm_head.weight.add_(torch.randn_like(expert.lm_head.weight) * 0.5)
    return expert


@pytest.fixture(scope="module")
def workspace(base_model, tmp_path_factory):
    """A base with a char tokenizer, lm_head-only checkpoint experts, their merge, a LoRA expert, data."""
    root = tmp_path_factory.mktemp("overlap_cli")
    tokenizer = char_tokenizer(CHARACTERS)
    base_model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    experts = [_lm_head_expert(base_model, seed) for seed in (41, 42)]
    for name, expert in zip(["ab", "cd"], experts):
        expert.save_pretrained(root / name)
    merge("task_arithmetic", base_model, experts, lam=1.0, out_dir=root / "merged", progress=False)
    random_lora_adapter(base_model, root / "lora", seed=43, scale=3.0)
    random_lora_adapter(
        base_model, root / "lora2", seed=44, scale=3.0, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    lines = [{"text": "ABCD ABCD XYZ"}, {"prompt": "CABBA >", "completion": "CBBBB"}, {"text": "DCBA AC"}]
    (root / "data.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return root


def test_char_tokenizer_and_batches_measure_observed_next_tokens(tmp_path):
    tokenizer = char_tokenizer("AB >")
    assert tokenizer("AB >A")["input_ids"] == [4, 5, 6, 7, 4]
    assert tokenizer.decode([4, 6, 5]) == "A B"
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ABAB"}\n\n{"prompt": "AB>", "completion": "BA"}\n')
    records = read_jsonl(path)
    assert records == [Record("", "ABAB"), Record("AB>", "BA")]
    batch = make_batches(encode_records(records, tokenizer, max_length=64), batch_size=2, pad_token_id=0)[0]
    assert batch["input_ids"].tolist() == [[0, 4, 5, 4, 5], [4, 5, 7, 5, 4]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # text: every position with a next token; prompt/completion: positions predicting "B", "A".
    assert batch["measure_mask"].tolist() == [[False, True, True, True, False], [False, False, True, True, False]]
    path.write_text('{"question": "?"}\n')
    with pytest.raises(ValueError, match="a record must be"):
        read_jsonl(path)


def test_overlap_cli_linear_checkpoints_with_merge(workspace, capsys):
    out = workspace / "out_linear"
    args = [
        "overlap",
        "--base",
        str(workspace / "base"),
        "--expert",
        str(workspace / "ab"),
        "--expert",
        str(workspace / "cd"),
    ]
    args += ["--merged", str(workspace / "merged"), "--data", str(workspace / "data.jsonl"), "--out", str(out)]
    args += ["--rollouts", "composed", "--rollouts", "experts", "--max-new-tokens", "4", "--quiet"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "mass overlap O" in printed and "ab + cd" in printed
    for name in ["overlap.json", "overlap.md", "config.yaml", "activity_heatmap.png", "gap_histogram.png"]:
        assert (out / name).stat().st_size > 0
    results = json.loads((out / "overlap.json").read_text())
    # 12 + 4 + 6 measured positions: text minus its last token; the completion's 5 tokens.
    assert results["num_positions"] == 12 + 5 + 6
    assert {"coactivation_rate", "experts", "pairs", "projective_error", "merge_compose_gap"} <= set(results)
    assert set(results["experts"]["ab"]) >= {"kl_mean", "active_fraction"}
    pair = results["pairs"]["ab|cd"]
    assert set(pair) >= {"mass_overlap", "sign_conflict", "parameter", "mass_overlap_bounds"}
    # The defaults: the base-weighted centre, token statistics on the top-k union, whose outside mass is given.
    assert results["settings"]["centre"] == "base_weighted_median" and results["settings"]["full_vocabulary"] is False
    assert set(results["vocabulary"]["outside_mass_mean"]) == {"base", "ab", "cd", "composed"}
    # lm_head-only experts: the merge equals the composition.
    assert results["merge_compose_gap"]["kl_max"] < 1e-5
    assert results["merge_compose_gap"]["top1_agreement"] == 1.0
    # Only lm_head moved: the trimmed masks live in one tensor, and the rollouts were measured.
    assert pair["parameter"]["trimmed_mask_jaccard"] > 0
    assert set(results["rollouts"]) == {"composed", "ab", "cd"}
    assert results["rollouts"]["composed"]["merge_compose_gap"]["kl_max"] < 1e-5
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["experts"] == [str(workspace / "ab"), str(workspace / "cd")] and config["settings"]["epsilon"] == 0.1
    assert "## Pairs" in (out / "overlap.md").read_text()
    # Which side keeps each expert's decisions: both systems measured (a merge was given), per expert and summed.
    assert set(results["retention"]["shifted_positions"]) == {"ab", "cd"}
    assert set(results["experts"]["ab"]["retention"]) == {"merge", "compose"}
    assert set(results["experts"]["ab"]["retention"]["merge"]) == {"kl_mean", "kept_share"}
    assert "## Which side keeps each expert's decisions" in (out / "overlap.md").read_text()
    # An existing output folder is refused, and kept as it was.
    assert main(args) == 2
    assert "overwrite" in capsys.readouterr().err
    assert json.loads((out / "overlap.json").read_text()) == results


def test_overlap_cli_adapter_and_checkpoint_from_yaml(workspace):
    out = workspace / "out_mixed"
    config = {
        "base": str(workspace / "base"),
        "experts": [str(workspace / "ab"), str(workspace / "lora")],
        "data": str(workspace / "data.jsonl"),
        "out": str(out),
        "lam": 0.5,
        "settings": {"epsilon": 0.05, "reservoir_size": 3},
    }
    path = workspace / "overlap.yaml"
    path.write_text(yaml.safe_dump(config))
    assert (
        main(["overlap", "--config", str(path), "--eta", "0.01", "--centre", "median", "--full-vocabulary", "--quiet"])
        == 0
    )
    results = json.loads((out / "overlap.json").read_text())
    assert results["settings"]["epsilon"] == 0.05 and results["settings"]["eta"] == 0.01
    assert results["settings"]["centre"] == "median" and results["settings"]["full_vocabulary"] is True
    assert "vocabulary" not in results and "mass_overlap_bounds" not in results["pairs"]["ab|lora"]
    assert len(results["reservoir"]) == 3
    pair = results["pairs"]["ab|lora"]
    # The lm_head expert and an attention/MLP LoRA touch disjoint parameters.
    assert pair["parameter"]["cosine"] == pytest.approx(0.0, abs=1e-12)
    assert pair["parameter"]["trimmed_mask_jaccard"] == 0.0
    # With λ = 0.5 the single-expert linearization error is measured: 0 for the lm_head expert.
    assert results["experts"]["ab"]["linearization_error"] < 1e-6
    assert results["experts"]["lora"]["linearization_error"] > 1e-6
    assert not (out / "gap_histogram.png").exists()
    # One expert is a full checkpoint: no input interference, and overlap.md says why.
    assert results["input_interference"] is None
    assert "Not measured: the experts are not all LoRA adapters." in (out / "overlap.md").read_text()


def test_overlap_cli_lora_experts_get_their_input_interference(workspace):
    out = workspace / "out_lora"
    argv = ["overlap", "--base", str(workspace / "base"), "--expert", str(workspace / "lora")]
    argv += ["--expert", str(workspace / "lora2"), "--data", str(workspace / "data.jsonl"), "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    interference = json.loads((out / "overlap.json").read_text())["input_interference"]
    assert set(interference["pairs"]) == {"lora→lora2", "lora2→lora"}
    assert len(interference["layers"]) == 14  # every linear of 2 layers: q, k, v, o, gate, up, down
    assert interference["max"] >= interference["mean"] > 0
    assert "## Input-space interference (LoRA experts, teacher-forced)" in (out / "overlap.md").read_text()


def test_overlap_cli_rejects_bad_configs(workspace, capsys):
    base = ["overlap", "--base", str(workspace / "base"), "--expert", str(workspace / "ab")]
    assert main(base + ["--data", str(workspace / "missing.jsonl"), "--out", str(workspace / "x")]) == 2
    assert "data" in capsys.readouterr().err
    assert (
        main(base + ["--data", str(workspace / "data.jsonl"), "--out", str(workspace / "x"), "--rollouts", "everyone"])
        == 2
    )
    assert "rollouts" in capsys.readouterr().err
    assert main(base + ["--data", str(workspace / "data.jsonl"), "--out", str(workspace / "x"), "--lam", "-1"]) == 2
    assert "lam" in capsys.readouterr().err
    assert not (workspace / "x").exists()


def test_overlap_cli_truncates_only_when_asked_and_says_so(workspace, capsys):
    args = [
        "overlap",
        "--base",
        str(workspace / "base"),
        "--expert",
        str(workspace / "ab"),
        "--expert",
        str(workspace / "cd"),
        "--data",
        str(workspace / "data.jsonl"),
        "--no-parameter-measures",
        "--max-length",
        "8",
        "--quiet",
    ]
    # Records of 13, 7 + 5 and 7 tokens: two are longer than 8.
    assert main([*args, "--out", str(workspace / "refused")]) == 2
    assert (
        "2 of 3 records are longer than 8 tokens (`max_length`), the longest (record 0) has 13"
        in capsys.readouterr().err
    )
    assert not (workspace / "refused").exists()
    out = workspace / "out_truncated"
    assert main([*args, "--out", str(out), "--truncate"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "mergecompose overlap: warning: 2 of 3 records are longer than 8 tokens (`max_length`): "
        "cut them to 8 tokens, dropping 9 tokens"
    ]
    # 7 positions of the cut text, 1 completion token left of the prompt/completion record, 6 of the short text.
    assert json.loads((out / "overlap.json").read_text())["num_positions"] == 7 + 1 + 6
    assert yaml.safe_load((out / "config.yaml").read_text())["truncate"] is True


def test_overlap_cli_measures_each_expert_on_its_own_prompts(workspace, capsys):
    """`--expert-data NAME=FILE`: expert NAME's greedy outputs from its own prompts, measured as `--rollouts
    expert:NAME` measures them from `--data`'s: the same numbers where the prompts are the same."""
    own = workspace / "ab_own.jsonl"
    own.write_text("\n".join(json.dumps({"prompt": p, "completion": "A"}) for p in ["ABBA >", "CAB >", "DD >"]) + "\n")
    common = ["overlap", "--base", str(workspace / "base"), "--expert", str(workspace / "ab")]
    common += ["--expert", str(workspace / "lora"), "--max-new-tokens", "5", "--quiet"]
    out = workspace / "out_expert_data"
    assert (
        main([*common, "--data", str(workspace / "data.jsonl"), "--expert-data", f"ab={own}", "--out", str(out)]) == 0
    )
    results = json.loads((out / "overlap.json").read_text())
    assert set(results["expert_data"]) == {"ab"}
    measured = results["expert_data"]["ab"]
    same = workspace / "out_expert_data_as_rollouts"
    assert main([*common, "--data", str(own), "--rollouts", "expert:ab", "--out", str(same)]) == 0
    rollouts = json.loads((same / "overlap.json").read_text())["rollouts"]["ab"]
    assert measured["num_positions"] == rollouts["num_positions"] > 0
    assert measured["experts"]["ab"]["retention"] == rollouts["experts"]["ab"]["retention"]
    assert measured["retention"] == rollouts["retention"]
    # Over the experts, only where each has its own prompts: here "lora" has none.
    assert results["own_prompt_statistics"] == dict.fromkeys(OWN_PROMPT_STATISTICS)
    both = workspace / "out_expert_data_both"
    argv = [*common, "--data", str(workspace / "data.jsonl"), "--expert-data", f"ab={own}"]
    assert main([*argv, "--expert-data", f"lora={own}", "--out", str(both)]) == 0
    measured_both = json.loads((both / "overlap.json").read_text())
    flat = measured_both["own_prompt_statistics"]
    assert flat == own_prompt_statistics(measured_both["expert_data"], ["ab", "lora"])
    rates = [measured_both["expert_data"][n]["experts"][n]["top1_shift_rate"] for n in ("ab", "lora")]
    assert flat["own_base_top1_agreement_min"] == pytest.approx(1 - max(rates))
    report = (out / "overlap.md").read_text()
    assert "## Which side keeps each expert's decisions (ab on its own prompts (its greedy outputs))" in report
    assert "ab's own prompts" in report  # a headline row
    # Bad input: one line each, before any model loads.
    for bad, message in [
        (f"nobody={own}", "`expert_data` names 'nobody', which is no expert; the experts are ['ab', 'lora']"),
        ("ab", "`--expert-data` must be NAME=FILE (an expert's name, then its prompts), got 'ab'"),
        (f"ab={workspace / 'missing.jsonl'}", "`expert_data['ab']` must be an existing .jsonl file"),
    ]:
        argv = [*common, "--data", str(own), "--expert-data", bad, "--out", str(workspace / "never")]
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("mergecompose overlap: error: ") and message in line, line
    argv = [*common, "--data", str(own), "--expert-data", f"ab={own}", "--expert-data", f"ab={own}"]
    assert main([*argv, "--out", str(workspace / "never")]) == 2
    assert "`--expert-data` names ab more than once" in capsys.readouterr().err
    assert not (workspace / "never").exists()
