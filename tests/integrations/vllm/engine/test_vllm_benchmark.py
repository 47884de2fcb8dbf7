"""`benchmarks.vllm_throughput` and `benchmarks.vllm_requests` run on given checkpoints (`--model`, `--expert`), at a
tiny size."""

from __future__ import annotations

import json

from benchmarks import vllm_requests, vllm_throughput


def test_throughput_benchmark_runs_on_a_checkpoint_with_its_adapters(tmp_path, component_folders):
    out = tmp_path / "vllm.json"
    experts = [str(component_folders["lora_a"]), str(component_folders["lora_b"])]
    argv = ["--model", str(component_folders["base"]), "--expert", *experts]
    assert (
        vllm_throughput.main([*argv, "--new-tokens", "4", "--batches", "1", "--repeats", "1", "--out", str(out)]) == 0
    )
    results = json.loads(out.read_text())
    assert set(results["systems"]) == {"base", "composed, 2 LoRA experts", "composed, 2 full experts"}
    assert all(system["tokens_per_s"]["1"]["wall"] > 0 for system in results["systems"].values())
    assert set(results["conditions"]) == {"start", "end"}


def test_requests_benchmark_runs_on_a_checkpoint_with_its_adapters(tmp_path, component_folders):
    out = tmp_path / "requests.json"
    experts = [str(component_folders["lora_a"]), str(component_folders["lora_b"])]
    argv = ["--model", str(component_folders["base"]), "--expert", *experts, "--new-tokens", "4", "--batches", "3"]
    assert vllm_requests.main([*argv, "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["mixes"]) == {"folder", "same, chosen", "mixed"}
    assert all(mix["3"]["wall"] > 0 for mix in results["mixes"].values())
