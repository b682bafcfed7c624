"""`ttsserve serve` refuses a setting that cannot work with one line on stderr and exit status 2, before the
model loads: the process is run for real (`python -m ttsserve.entrypoints.cli serve`), and a single stderr
line proves no load started (the load logs "loading model" and the dummy banner to stderr)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.tiny_args import TINY_CLI_ARGS

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *TINY_CLI_ARGS,
    "--voices-db",
    ":memory:",
]
# Interpreter start + `import torch` is 3-6 s here; a real-size load is far more. Generous for a busy CI box.
FAST_S = 45.0


def _serve(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "TTSSERVE_API_KEY"} | (env or {})
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ttsserve.entrypoints.cli", "serve", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr.splitlines(), time.monotonic() - start


def _assert_refused(args: list[str], needle: str, env: dict[str, str] | None = None) -> str:
    rc, lines, took = _serve(args, env)
    assert rc == 2, (rc, lines[-20:])
    assert len(lines) == 1, lines[-20:]  # one line: no traceback, and no "loading model" before it
    assert lines[0].startswith("ttsserve serve: error: ") and needle in lines[0], lines[0]
    assert took < FAST_S
    return lines[0]


def test_a_bad_model_path(tmp_path):
    _assert_refused(["--model", str(tmp_path / "nowhere")], "nowhere: no such checkpoint folder")
    (tmp_path / "ckpt" / "asset" / "gpt").mkdir(parents=True)
    _assert_refused(["--model", str(tmp_path / "ckpt")], "missing file(s): asset/gpt/config.json")
    _assert_refused(["--model", str(tmp_path)], "not a ChatTTS checkpoint")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu():
    _assert_refused([*TINY[:4], "--device", "cuda"], "device 'cuda' requested but CUDA is not available")


def test_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _assert_refused([*TINY, "--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use")


@pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"), reason="no SO_REUSEPORT here")
def test_several_api_servers_never_join_a_port_group_they_did_not_make():
    """With --api-server-count > 1 each API server gets a socket of one SO_REUSEPORT group. Another
    server of this user already listening on the port with SO_REUSEPORT would silently take half of the
    traffic if we joined its group: the port is probed with a plain bind first, so it is 'in use'."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        _assert_refused(
            [*TINY, "--port", str(port), "--api-server-count", "2"],
            f"cannot listen on 127.0.0.1:{port}: Address already in use",
        )
    from ttsserve.server.preflight import bind_socket

    first = bind_socket("127.0.0.1", 0, reuse_port=True)  # ours: another socket of the group may join it
    try:
        port = first.getsockname()[1]
        first.listen()
        bind_socket("127.0.0.1", port, join=True).close()
        with pytest.raises(ValueError, match="Address already in use"):
            bind_socket("127.0.0.1", port)  # and a plain socket (anyone else) may not
    finally:
        first.close()


def test_api_servers_refuse_a_bad_setting_with_one_line(tmp_path):
    """With API servers the engine check runs in the launcher while the gated core imports torch: the core is
    stopped before it prints anything, and no process is left behind."""
    _assert_refused(["--model", str(tmp_path / "nowhere"), "--api-server-count", "1"], "no such checkpoint folder")
    _assert_refused([*TINY, "--api-server-count", "2", "--kv-cache-memory", "16K"], "holds fewer than 2 blocks")


def test_a_bad_engine_value():
    # A value EngineConfig accepts but the model's sizes refuse: found from config.json alone, before the load.
    _assert_refused([*TINY, "--kv-cache-memory", "16K"], "KV cache budget of 0.0 MiB holds fewer than 2 blocks")


def test_a_blank_api_key_refuses_to_start():
    line = _assert_refused([*TINY, "--api-key", "k1,"], "--api-key: key 2 of 2 is blank")
    assert "k1" not in line  # keys are secrets: the message names positions, never values


# The same contract in-process (a subprocess each would add minutes to the suite): run_serve returns 2 with one
# line on stderr, and the engine is never built.
@pytest.mark.parametrize(
    "args, env, needle",
    [
        (["--block-size", "7"], {}, "block_size must be one of 8, 16, 32, 64, 128"),
        (["--max-num-seqs", "many"], {}, "--max-num-seqs: invalid literal"),
        ([], {"TTSSERVE_GPU_MEMORY_UTILIZATION": "2"}, "gpu_memory_utilization must be in [0.05, 0.99]"),
        (["--seed", str(2**64)], {}, "seed (of the dummy weights) must be in [0, 2**63)"),
        (["--kv-cache-dtype", "fp8"], {}, "kv_cache_dtype fp8 needs a CUDA device"),
        (["--device", "cuda:99"], {}, "device 'cuda:99' requested but"),
        (["--load-format", "safetensors"], {"TTSSERVE_MODEL": "/nowhere/ckpt"}, "/nowhere/ckpt: no such checkpoint"),
        (["--api-key", ""], {}, "--api-key: key 1 of 1 is blank"),
        (["--api-key", "k1", "--api-key", " "], {}, "--api-key: key 2 of 2 is blank"),
        ([], {"TTSSERVE_API_KEY": ""}, "TTSSERVE_API_KEY: key 1 of 1 is blank"),
        ([], {"TTSSERVE_API_KEY": "k1,,k2"}, "TTSSERVE_API_KEY: key 2 of 3 is blank"),
        (["--host", "no-such-host.invalid"], {}, "cannot listen on no-such-host.invalid:8000"),
    ],
    ids=[
        "block-size",
        "not-an-int",
        "env",
        "dummy-seed",
        "fp8-on-cpu",
        "cuda-index",
        "model-env",
        "blank-key",
        "blank-second-key",
        "blank-env-key",
        "blank-env-item",
        "bad-host",
    ],
)
def test_refused_before_the_engine_is_built(args, env, needle, monkeypatch, capsys):
    from ttsserve.engine.core.async_engine import AsyncEngine
    from ttsserve.entrypoints.serve import run_serve
    from ttsserve.server.args import add_serve_arguments

    def no_load(*_a, **_k):
        raise AssertionError("the model load was reached")

    monkeypatch.setattr(AsyncEngine, "from_config", no_load)
    monkeypatch.delenv("TTSSERVE_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parsed = add_serve_arguments(argparse.ArgumentParser()).parse_args([*TINY, *args])
    assert run_serve(parsed) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ttsserve serve: error: ") and needle in lines[0], lines


def test_the_launcher_spawns_its_cores_before_it_imports_torch() -> None:
    """With API servers, `import torch` (seconds: 5.5 s on the H200's read-only install) happens in the core
    processes first; the launcher's own flag checks import it while they load, not before they start."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "import sys\n"
        "from ttsserve.entrypoints import core_slots, serve\n"
        "def spawn(self, gated=False):\n"
        "    print('torch imported at spawn:', 'torch' in sys.modules)\n"
        "    raise KeyboardInterrupt\n"
        "core_slots.CoreSlot.spawn = spawn\n"
        "try:\n"
        f"    serve.main(['--api-server-count', '1', '--port', '{port}', *{TINY!r}])\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "torch imported at spawn: False" in proc.stdout, proc.stdout + proc.stderr


def test_an_api_server_starts_without_torch() -> None:
    """An API server process (launcher_procs._api_server_main) builds its app without importing torch: twelve of
    them importing it beside a loading engine core slowed the core's own import on the H200."""
    script = (
        "import sys\n"
        "from ttsserve.engine.core.dp_client import DPClient\n"
        "from ttsserve.server.app import create_app\n"
        "from ttsserve.server.args import ServerConfig\n"
        "create_app(DPClient(['ipc:///nonexistent-core.sock'], 0, 5.0, handshake_timeout_s=None), ServerConfig())\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "torch imported: False" in proc.stdout, proc.stdout + proc.stderr
