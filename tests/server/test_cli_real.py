"""`python -m ttsserve.entrypoints.serve` as a real process on the real engine: flags + env, the memory report
at start, API keys, voices on disk, and a clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.tiny_args import TINY_CLI_ARGS

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process_end_to_end(tmp_path):
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "ttsserve.entrypoints.serve",
        *TINY_CLI_ARGS,
        "--kv-cache-memory",
        "64MiB",
        "--port",
        str(port),
        "--api-key",
        "sk-1,sk-2",
        "--voices-db",
        str(tmp_path / "voices.db"),
        "--max-new-tokens",
        "16",
    ]
    env = {**os.environ, "TTSSERVE_SWAP_SPACE": "0", "TTSSERVE_MAX_NUM_SEQS": "8", "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-2", max_retries=0)
        audio = client.audio.speech.create(
            model="tts-1", voice="nova", input="From a real process.", response_format="wav"
        ).content
        assert audio[:4] == b"RIFF" and len(audio) > 44
        r = httpx.post(
            url + "/v1/audio/voices", json={"name": "kept", "seed": 5}, headers={"Authorization": "Bearer sk-1"}
        )
        assert r.status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # a clean drain exits 0 (server/drain.py)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "serve.log").read_text()
    assert "ttsserve ready: KV cache:" in out and "concurrent" in out  # how many streams fit, at start
    assert f"ready: playground http://127.0.0.1:{port}/  API docs http://127.0.0.1:{port}/docs" in out
    assert f"voices database: {tmp_path / 'voices.db'}" in out
    assert "Application shutdown complete" in out
    assert '"event": "access"' in out and '"path": "/v1/audio/speech"' in out
    assert (tmp_path / "voices.db").exists()
