"""POST /start_profile and /stop_profile (server/profile_routes.py, engine/profiler.py) on real servers: the
in-process engine and `ttsserve serve` with an engine-core process. Each writes a gzipped Chrome trace in
$TTSSERVE_TORCH_PROFILER_DIR holding the engine step's torch ops (on a thread of its own: the server keeps
serving while it is written); misuse is a 400 that names it, a plain key a
403, and a server started without the variable has no such routes."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import httpx

from tests.server.conftest import wait_until
from tests.server.multiproc_helpers import ServeProcess

SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm", "max_new_tokens": 12}
ENV = "TTSSERVE_TORCH_PROFILER_DIR"


def _ops(trace: str) -> set[str]:
    with gzip.open(trace, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def _profile_one_request(client: httpx.Client, admin: dict, out_dir: Path) -> str:
    """Misuse first (each a 400 naming it), then start, one synthesis, stop -> the one trace's path."""
    r = client.post("/stop_profile", headers=admin)
    assert r.status_code == 400 and "not running" in r.json()["error"]["message"], r.text
    assert client.post("/start_profile", headers=admin).json() == {"status": "profiling", "dir": str(out_dir)}
    r = client.post("/start_profile", headers=admin)
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"], r.text
    assert client.post("/v1/audio/speech", json=SPEECH, headers=admin).status_code == 200
    r = client.post("/stop_profile", headers=admin)
    assert r.status_code == 200, r.text
    [trace] = r.json()["traces"]
    assert Path(trace).parent == out_dir
    assert wait_until(lambda: Path(trace).exists(), timeout=120), "the trace was not written"  # a writer thread's
    assert not list(out_dir.glob("*.part*"))  # renamed once complete
    return trace


def test_the_in_process_engine_profiles_its_steps(serve_real, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    srv, _ = serve_real(api_keys=("plain",), admin_api_keys=("boss",))
    with srv.client() as c:
        r = c.post("/start_profile", headers={"Authorization": "Bearer plain"})
        assert r.status_code == 403 and "admin" in r.json()["error"]["message"], r.text
        assert c.post("/start_profile").status_code == 401
        trace = _profile_one_request(c, {"Authorization": "Bearer boss"}, tmp_path)
    ops = _ops(trace)
    assert any(n.startswith("aten::") for n in ops), sorted(ops)[:20]  # the engine thread's torch ops


def test_the_engine_core_process_writes_the_trace(tmp_path, monkeypatch):
    out = tmp_path / "traces"
    monkeypatch.setenv(ENV, str(out))
    server = ServeProcess(tmp_path, count=1)
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            trace = _profile_one_request(c, {}, out)
            assert f"-{server.pid_of('engine core')}-" in Path(trace).name  # written by the core, not the server
            assert c.post("/v1/audio/speech", json=SPEECH).status_code == 200  # still serving
    finally:
        server.stop()
    assert any(n.startswith("aten::") for n in _ops(trace))


def test_without_the_variable_there_are_no_profile_routes(serve, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    srv, _ = serve()
    with srv.client() as c:
        assert c.post("/start_profile").status_code == 404
        assert c.post("/stop_profile").status_code == 404
    assert ENV not in os.environ


def test_a_dead_engine_is_a_503_not_a_crash(serve, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    srv, engine = serve()
    engine.dead, engine.dead_reason = True, "the engine core exited"
    with srv.client() as c:
        for route in ("/start_profile", "/stop_profile"):
            r = c.post(route)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
            assert "exited" in r.json()["error"]["message"]
