"""Each benchmark runs end to end at tiny sizes. No figure is asserted: these only prove they run."""

import json

from benchmarks import decode, merge, precision
from benchmarks import lm_eval as lm_eval_benchmark


def test_decode_benchmark_runs(tmp_path):
    out = tmp_path / "decode.json"
    assert decode.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["batches"]["1"]) == {"base", "full", "lora", "naive"}
    assert set(results["peak_rss_mb"]) == {"base", "full", "lora", "naive"}


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
