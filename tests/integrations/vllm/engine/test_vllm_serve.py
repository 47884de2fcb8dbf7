"""`vllm serve` on a composed model folder, queried with the `openai` client: the text of ComposedLM's greedy run.

The test starts the server on 127.0.0.1 (a free port), waits for /health, and stops it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoTokenizer
from vllm_engines import prompts

from mergecompose.composition import ComposedLM

MAX_NEW_TOKENS = 16
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def server(composed_folders, tmp_path_factory):
    """(base URL, model name) of a running `vllm serve` of the LoRA composition."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("vllm_serve") / "server.log"
    folder = str(composed_folders["lora"])
    command = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        folder,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True
        )
    try:
        _wait_until_healthy(f"http://127.0.0.1:{port}/health", process, log)
        yield f"http://127.0.0.1:{port}/v1", folder
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_until_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vllm serve was not healthy after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def expected_texts(component_folders):
    """ComposedLM's greedy continuation of each prompt, as text."""
    tokenizer = AutoTokenizer.from_pretrained(str(component_folders["base"]))
    experts = [str(component_folders["lora_a"]), str(component_folders["lora_b"])]
    texts = {}
    with ComposedLM.from_pretrained(str(component_folders["base"]), experts, weights=[1.0, 0.5]) as composed:
        for prompt in prompts(4, seed=3):
            ids = torch.tensor([prompt])
            out = composed.generate(
                ids,
                torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
            texts[tokenizer.decode(prompt)] = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    return texts


def test_completions_and_chat_give_the_composed_text(server, expected_texts):
    base_url, model = server
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    for prompt, expected in expected_texts.items():
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        assert completion.choices[0].text == expected, prompt
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_NEW_TOKENS, temperature=0.0
        )
        assert chat.choices[0].message.content == expected, prompt
    assert len(set(expected_texts.values())) > 1
