"""The speculative systems of `benchmarks.decode` and `benchmarks.decode_gpu_gemma` run, at tiny sizes."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks import decode, decode_gpu_gemma

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_decode_speculative_systems_run(tmp_path):
    out = tmp_path / "decode.json"
    systems = ["base", "full", "full+spec", "lora", "lora+spec"]
    with pytest.warns(UserWarning, match="share one base"):
        assert decode.main(["--smoke", "--systems", *systems, "--no-memory", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["batches"]["1"]
    assert set(rows) == set(systems)
    for name, plain in decode.SPECULATIVE.items():
        assert 0 <= rows[name]["acceptance_rate"] <= 1 and rows[name]["rounds"] > 0
        assert rows[name]["ratio_to_composition"] == pytest.approx(
            rows[name]["tokens_per_second"] / rows[plain]["tokens_per_second"]
        )


def test_decode_on_letters_models_of_a_run_folder(tmp_path):
    """`--letters RUN_DIR` trains what the run folder lacks (here 3 steps each) and decodes held-out joint strings."""
    config = yaml.safe_load(open("configs/letters.yaml"))
    for settings in [
        config["training"]["base"],
        config["training"]["experts"]["full"],
        config["training"]["experts"]["lora"]["training"],
    ]:
        settings["steps"] = 3
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "letters.json"
    assert (
        decode.main(
            [
                "--letters",
                str(run),
                "--systems",
                "base",
                "full",
                "full+spec",
                "--batch-sizes",
                "1",
                "2",
                "--letters-strings",
                "4",
                "--letters-length",
                "5",
                "--repeats",
                "1",
                "--no-memory",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert results["args"]["new_tokens"] == 6  # 5 characters and EOS
    assert set(results["batches"]["2"]) == {"base", "full", "full+spec"}
    assert results["batches"]["1"]["full+spec"]["emitted"] == 4 * 6  # every string, every repeat counted once


def test_gemma_gpu_script_runs_tiny_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "gemma.json"
    assert (
        decode_gpu_gemma.main(
            ["--tiny", "--new-tokens", "12", "--prompt-length", "8", "--repeats", "1", "--out", str(out)]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert line == json.loads(out.read_text())
    assert line["greedy_outputs_equal"] and line["tokens_equal_before_first_difference"] == [12]
    assert set(line["tokens_per_second"]) == {"base", "lora", "full", "full+spec"} and 0 <= line["acceptance_rate"] <= 1
    assert line["lora_over_base"] > 0 and line["rank"] == 8
