"""A value of the form owner/name that is no local folder is looked up on the hub once, briefly: with the hub
unreachable the answer comes at once and says why (`mergecompose.core.sources.check_hub_reachable`)."""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest
from huggingface_hub import constants

from mergecompose.core import sources
from mergecompose.core.boundary import check_adapter, check_checkpoint, check_model_or_adapter, check_tokenizer


@pytest.fixture
def closed_hub(monkeypatch, tmp_path):
    """`HF_ENDPOINT` at a local port nobody listens on, online mode, an empty hub cache, cwd in a fresh folder."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    return endpoint


@pytest.mark.parametrize(
    "check", [check_checkpoint, check_adapter, check_model_or_adapter, check_tokenizer, sources.source_kind]
)
def test_a_relative_path_taken_for_a_hub_id_is_refused_at_once(closed_hub, check):
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        check("missing_dir/base", "base")
    assert time.monotonic() - start < sources.HUB_TIMEOUT_SECONDS + 1
    assert str(caught.value) == (
        "`base` 'missing_dir/base': no such local folder, and not reachable as a hub id "
        f"({closed_hub}: [Errno 111] Connection refused)"
    )


def test_a_hub_that_answers_404_is_named(monkeypatch, closed_hub):
    """A server that answers every request with 404 (as the hub does for an unknown repo)."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match=rf"not reachable as a hub id \({endpoint} answered 404 not found\)"):
            check_checkpoint("missing_dir/base", "base")
    finally:
        server.shutdown()
        server.server_close()
