"""Each benchmark runs end to end at tiny sizes. No figure is asserted: these only prove they run."""

import argparse
import json

import pytest
from transformers import AutoTokenizer

from benchmarks import decode, merge, precision
from benchmarks import lm_eval as lm_eval_benchmark
from benchmarks.real_model import add_model_arguments
from mergecompose.studies.math_code.math_problems import math_split


def test_decode_benchmark_runs(tmp_path):
    out = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    systems = {"base", "kernels", "full", "lora", "naive"}
    assert set(results["batches"]["1"]) == systems and set(results["peak_rss_mb"]) == systems
    assert "ratio_to_same_kernels" in results["batches"]["1"]["lora"]
    # What the timing chose: packed or dense for the LoRA composition's base, and the same for (a').
    packing = results["speed_choices"]["lora"]["packed weights"]["chosen"]
    assert results["speed_choices"]["kernels"]["packed"] is (packing == "packed")


def test_lm_eval_benchmark_runs(tmp_path):
    out = tmp_path / "lm_eval.json"
    assert lm_eval_benchmark.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["batches"]) == {"1", "2"}
    for rows in results["batches"].values():
        assert set(rows) == {"hf", "composed"}
        assert all(row["tokens"] > 0 for row in rows.values())


def test_precision_benchmark_runs(tmp_path):
    out = tmp_path / "precision.json"
    results = precision.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == {"2": results["rows"][2]}
    assert results["auto"] == ("bfloat16" if results["fast_bfloat16"] else "float32")


def test_merge_benchmark_runs(tmp_path):
    out = tmp_path / "merge.json"
    assert merge.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path)]) == 0
    results = json.loads(out.read_text())
    assert {"disk", "memory", "max_abs_difference_disk_vs_memory"} <= set(results)


def test_analysis_benchmark_runs(tmp_path):
    from benchmarks import analysis

    out = tmp_path / "analysis.json"
    assert analysis.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {"64", "256"} == set(results["tokens"])
    assert "memory_growth" in results


def test_compare_benchmark_runs(tmp_path):
    import yaml
    from test_compare import SMALL

    from benchmarks import compare

    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "compare.json"
    assert compare.main(["--config", str(config), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["from_nothing_seconds"] > 0 and results["cached_seconds"] > 0


def test_decode_benchmark_runs_on_a_checkpoint_with_its_adapters(tmp_path, checkpoints, lora_dirs):
    out = tmp_path / "decode.json"
    experts = [str(lora_dirs["ab"]), str(lora_dirs["cd"])]
    systems = ["base", "full", "lora", "full+spec"]
    argv = ["--smoke", "--model", str(checkpoints / "base"), "--expert", *experts, "--systems", *systems]
    assert decode.main([*argv, "--out", str(out), "--no-memory", "--profile", "3"]) == 0
    results = json.loads(out.read_text())
    assert set(results["batches"]["1"]) == set(systems)
    assert set(results["profile"]) == set(systems) and all(len(rows) == 3 for rows in results["profile"].values())
    assert results["args"]["model"] == str(checkpoints / "base")
    assert set(results["conditions"]) == {"start", "end"}
    assert results["conditions"]["start"]["interleaved_repeats"] == 1


def test_lm_eval_benchmark_runs_on_the_real_model_with_its_adapters(tmp_path, smollm2_dir, smollm2_adapters):
    out = tmp_path / "lm_eval.json"
    experts = [str(smollm2_adapters["math"]), str(smollm2_adapters["code"])]
    argv = ["--smoke", "--model", str(smollm2_dir), "--expert", *experts, "--batch-sizes", "2", "--prompts", "2"]
    assert lm_eval_benchmark.main([*argv, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = results["batches"]["2"]
    assert set(rows) == {"hf", "composed"} and all(row["tokens"] > 0 for row in rows.values())
    assert results["args"]["model"] == str(smollm2_dir)


def test_decode_benchmark_takes_math_prompts_on_the_real_model(tmp_path, smollm2_dir, smollm2_adapters):
    out = tmp_path / "decode.json"
    experts = [str(smollm2_adapters["math"]), str(smollm2_adapters["code"])]
    systems = ["base", "lora", "full+spec"]
    argv = ["--smoke", "--model", str(smollm2_dir), "--expert", *experts, "--prompts", "math", "--math-prompts", "2"]
    assert decode.main([*argv, "--systems", *systems, "--fixed-draft", "--out", str(out), "--no-memory"]) == 0
    results = json.loads(out.read_text())
    assert set(results["batches"]["1"]) == set(results["batches"]["2"]) == set(systems)
    assert results["args"]["prompts"] == "math"
    spec = results["batches"]["1"]["full+spec"]
    assert spec["plain_rounds"] == 0 and spec["drafted"] > 0  # K fixed: every round drafts (adaptive: round 2 not)

    # The batches are the math test split's problems as the study renders them, left-padded.
    args = decode.build_parser().parse_args([*argv, "--systems", "base"])
    decode.apply_smoke(args)
    bench = decode.Workbench(args, ["base"])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    problems = math_split("test", 2)
    assert len(bench.prompts(1)) == 2 and len(bench.prompts(2)) == 1
    (batch,) = bench.prompts(2)
    texts = tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert all(problem.question in text for problem, text in zip(problems, texts))
    assert (batch["attention_mask"][:, -1] == 1).all() and (batch["attention_mask"] == 0).any()  # padded on the left


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "math"], "--prompts: 'math' needs a real base's tokenizer (--model)"),
        (["--model", "some/base", "--prompts", "math", "--math-prompts", "2"], "--math-prompts: must be at least"),
    ],
)
def test_decode_benchmark_refuses_math_prompts_it_cannot_build(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode.main([*argv, "--batch-sizes", "1", "8"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--expert", "a", "--expert", "b"], ["--expert", "a", "b"], ["--expert", "a", "--expert", "b", "c"]],
)
def test_the_experts_are_every_expert_flag_s_values(argv):
    """`--expert A --expert B` keeps both, as the commands do; `--expert A B` does too."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args(argv).expert == [value for value in argv if value != "--expert"]
    assert parser.parse_args([]).expert is None
