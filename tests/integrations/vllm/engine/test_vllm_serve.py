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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer
from vllm_engines import greedy_references, prompts

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
    requests = prompts(4, seed=3)
    folder = {"folder": (["lora_a", "lora_b"], [1.0, 0.5])}
    tokens = greedy_references(component_folders, folder, requests, MAX_NEW_TOKENS)["folder"]
    return {
        tokenizer.decode(prompt): tokenizer.decode(out, skip_special_tokens=True)
        for prompt, out in zip(requests, tokens)
    }


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


# Three choices of one server (`vllm_xargs`, integrations/vllm/choice.py), and the reference of each.
CHOICES = {
    "base alone": ({"experts": ""}, (["lora_a"], [0.0])),
    "a alone": ({"experts": "lora_a"}, (["lora_a"], [1.0])),
    "a + 0.5 b": ({"experts": "lora_a,lora_b", "weights": "1,0.5"}, (["lora_a", "lora_b"], [1.0, 0.5])),
}


def test_three_requests_three_choices_one_server(server, component_folders):
    """Concurrent requests, each with its own experts, share the server's batches; each gets ComposedLM's text."""
    base_url, model = server
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    tokenizer = AutoTokenizer.from_pretrained(str(component_folders["base"]))
    requests = prompts(3, seed=8)
    references = greedy_references(component_folders, {name: c[1] for name, c in CHOICES.items()}, requests, 16)

    def complete(job):
        name, prompt = job
        completion = client.completions.create(
            model=model,
            prompt=tokenizer.decode(prompt),
            max_tokens=MAX_NEW_TOKENS,
            temperature=0.0,
            extra_body={"vllm_xargs": CHOICES[name][0]},
        )
        return completion.choices[0].text

    jobs = [(name, prompt) for prompt in requests for name in CHOICES]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(complete, jobs))
    for (name, prompt), text in zip(jobs, texts):
        index = requests.index(prompt)
        assert text == tokenizer.decode(references[name][index], skip_special_tokens=True), (name, index)
    assert len({text for (name, prompt), text in zip(jobs, texts) if prompt == requests[0]}) == 3


@pytest.mark.parametrize(
    ("xargs", "message"),
    [
        ({"experts": "lora_z"}, "unknown expert 'lora_z'"),
        ({"experts": "lora_a,lora_b", "weights": "1"}, "holds 1 weights for the 2 experts"),
        ({"experts": "lora_a", "weights": "nan"}, "each weight must be a finite number"),
        ({"experts": "lora_a", "weights": "inf"}, "each weight must be a finite number"),
        ({"experts": "lora_a", "weights": "much"}, "`weights` 'much' is not a number"),
        ({"Experts": "lora_a"}, "`vllm_xargs` key 'Experts' is a near miss of `experts`"),
        ({"experts": "lora_a", "weights": "1_0"}, "`weights` '1_0' is not a number"),
    ],
)
def test_a_bad_choice_gets_a_400_and_the_server_goes_on(server, xargs, message):
    base_url, model = server
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="ab", max_tokens=2, extra_body={"vllm_xargs": xargs})
    assert refused.value.status_code == 400
    error = refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)
    assert message in error and "\n" not in error
    good = client.completions.create(
        model=model, prompt="ab", max_tokens=2, temperature=0.0, extra_body={"vllm_xargs": {"experts": "lora_b"}}
    )
    assert good.choices[0].finish_reason in ("length", "stop")


def test_what_reaches_our_check_through_the_server(server):
    """A long value is quoted cut short in our one line; a nested value is refused by vLLM's request model first
    (`vllm_xargs: dict[str, str | int | float | list[str | int | float]]`), with its own multi-line message; a JSON
    boolean reaches our check as 1 (the request model's conversion), so it is served as weight 1."""
    base_url, model = server
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)

    def refusal(xargs) -> str:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt="ab", max_tokens=2, extra_body={"vllm_xargs": xargs})
        assert refused.value.status_code == 400
        return refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)

    long = refusal({"experts": "lora_a", "weights": [0.5] * 20_000})
    assert long.startswith("`weights` [0.5, 0.5") and "…" in long and len(long) < 400 and "\n" not in long
    nested = refusal({"experts": {"lora_a": 1}})
    assert "vllm_xargs.experts" in nested and "validation errors" in nested  # vLLM's, before any processor
    served = client.completions.create(
        model=model, prompt="ab", max_tokens=2, extra_body={"vllm_xargs": {"experts": "lora_a", "weights": True}}
    )
    assert served.choices[0].finish_reason in ("length", "stop")
