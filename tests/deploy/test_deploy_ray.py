"""Ray Serve deployment (ttsserve/deploy/ray.py): options from `serve run ... key=value` arguments, the health
check against the app's /ready, and a real local Ray instance serving two tiny CPU replicas (each an engine-core
process + the app around a CoreClient) over HTTP: requests spread over both, a replica or an engine core killed
with SIGKILL mid-batch fails only its own streams and is replaced, deleting the app stops every core.
Skips when ray[serve] is not installed, or when a local Ray instance cannot start here."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_helpers import ROOT, free_port

serve = pytest.importorskip("ray.serve", reason="ray[serve] not installed (pip install 'ray[serve]')")
ray_deploy = pytest.importorskip("ttsserve.deploy.ray")

from tests.server.fake_engine import FakeEngine  # noqa: E402
from ttsserve.deploy.core_process import CoreStartError, EngineCoreProcess  # noqa: E402
from ttsserve.engine.core.launch import RUN_DIR_PREFIX, clean_stale_run_dirs  # noqa: E402
from ttsserve.server.app import ServerConfig, create_app  # noqa: E402

TINY = {
    "load_format": "dummy",
    "dummy_size": "tiny",
    "dtype": "float32",
    "device": "cpu",
    "kv_cache_memory": "64M",
    "swap_space": 0,
}
APP = "ttsserve"
# min == max: the dummy model's EOS cannot end a stream early, so every stream of a batch is still running
# when one replica is killed (a few seconds for 8 streams on 2 shared cores).
LONG = {"model": "chattts", "voice": "alloy", "response_format": "pcm", "min_new_tokens": 600, "max_new_tokens": 600}


# ---- options (no Ray instance) -------------------------------------------------------------------------
def test_autoscaling_options_by_default() -> None:
    ray_opts, serve_opts = ray_deploy.split_args({"max-replicas": "8", "model": "/m", "target_ongoing_requests": 4})
    assert serve_opts == {"model": "/m"}
    opts = ray_deploy.deployment_options(ray_opts, ray_deploy.EngineConfig(), drain_timeout_s=30)
    auto = opts["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 8, 4.0)
    assert "num_replicas" not in opts
    assert opts["ray_actor_options"]["num_gpus"] == 1.0  # one GPU per replica unless the engine runs on CPU
    assert opts["graceful_shutdown_timeout_s"] == 35.0


def test_fixed_replicas_on_cpu_and_bad_values() -> None:
    ray_opts, _ = ray_deploy.split_args({"num_replicas": 3})
    opts = ray_deploy.deployment_options(ray_opts, ray_deploy.EngineConfig(device="cpu"), drain_timeout_s=0)
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"]["num_gpus"] == 0.0
    with pytest.raises(ValueError, match="max_replicas"):
        ray_deploy.split_args({"max_replicas": "many"})
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        ray_deploy.deployment_options(ray_deploy.split_args({"min_replicas": 5})[0], ray_deploy.EngineConfig(), 0)
    with pytest.raises(ValueError, match="dummy_size"):  # engine settings are validated on the driver
        ray_deploy.build_app({"dummy_size": "huge"})


def test_serve_run_strings_become_serve_flags() -> None:
    args = {"load_format": "dummy", "enforce_eager": "true", "enable_prefix_caching": "False", "block_size": 32}
    assert ray_deploy._serve_args(args) == [
        "--load-format",
        "dummy",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--block-size",
        "32",
    ]
    with pytest.raises(ValueError, match="enforce_eager"):
        ray_deploy._serve_args({"enforce_eager": "maybe"})


def test_check_health_fails_exactly_when_ready_answers_503() -> None:
    from fastapi.testclient import TestClient

    engine = FakeEngine()
    app = create_app(engine, ServerConfig(voices_db=":memory:"))
    replica = types.SimpleNamespace(_client=engine, _app=app)

    def health() -> str | None:
        try:
            ray_deploy.TTSServeReplica.check_health(replica)
        except ray_deploy.ReplicaUnhealthyError as e:
            return str(e)
        return None

    with TestClient(app) as http:

        def ready() -> str | None:
            r = http.get("/ready")
            return None if r.status_code == 200 else r.json()["error"]["message"]

        assert health() is None and ready() is None
        engine.dead, engine.dead_reason, engine._accepting = True, "the engine core process is gone", False
        assert health() == ready() == "the engine core process is gone"
        engine.dead, engine.dead_reason, engine._accepting = False, None, True
        app.state.server.gate.closed = True  # shutting down: /ready turns 503 before the engine stops
        assert health() == ready() == "engine not ready"


def test_a_core_that_fails_to_start_is_a_typed_error_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    missing = {"load_format": "safetensors", "model": str(tmp_path / "missing")}  # a checkpoint that is not there
    cfg = ray_deploy.EngineConfig(**{**TINY, "kv_cache_memory": 64 << 20, **missing})
    core = EngineCoreProcess(cfg, drain_timeout_s=1, log_level="error")
    with pytest.raises(CoreStartError, match=r"failed to start: ValueError: .*missing"):
        core.start()
    assert not core.alive and os.listdir(tmp_path) == []


def test_run_dirs_of_dead_owners_are_removed(tmp_path) -> None:
    dead_pid = _exited_pid()
    for name, owner in (("dead", str(dead_pid)), ("live", str(os.getppid())), ("unmarked", None)):
        d = tmp_path / (RUN_DIR_PREFIX + name)
        d.mkdir()
        if owner is not None:
            (d / "owner.pid").write_text(owner)
    assert clean_stale_run_dirs(str(tmp_path)) == [str(tmp_path / (RUN_DIR_PREFIX + "dead"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_DIR_PREFIX + "live", RUN_DIR_PREFIX + "unmarked"]


def _exited_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ---- a real local Ray instance ---------------------------------------------------------------------------
@dataclass
class RayApp:
    url: str
    run_root: str  # the replicas' $TMPDIR: one engine-core run directory per live core

    def run_dirs(self) -> list[str]:
        return glob.glob(os.path.join(self.run_root, RUN_DIR_PREFIX + "*"))

    def replicas(self) -> dict[str, int]:
        """Live replica id -> the pid of its Ray actor process (Ray's state API)."""
        from ray.util.state import list_actors

        prefix = f"SERVE_REPLICA::{APP}#{APP}#"
        actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
        return {a.name[len(prefix) :]: a.pid for a in actors if (a.name or "").startswith(prefix)}

    def deploy(self) -> None:
        app = ray_deploy.build_app(
            {**TINY, "num_replicas": 2, "num_cpus": 0.5, "health_check_period_s": 1, "log_level": "warning"}
        )
        serve.run(app, name=APP, route_prefix="/", blocking=False)

    def wait_running(self, timeout_s: float, gone: str | None = None) -> dict[str, int]:
        """Both replicas RUNNING (and `gone` no longer among them); their ids -> actor pids."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            app = serve.status().applications.get(APP)
            if app is not None and app.status == "RUNNING":
                states = dict(app.deployments[APP].replica_states)
                replicas = self.replicas()
                if states == {"RUNNING": 2} and len(replicas) == 2 and gone not in replicas:
                    return replicas
            time.sleep(0.3)
        raise AssertionError(f"not 2 running replicas within {timeout_s} s: {serve.status()}")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")  # replica workers
    run_root = tempfile.mkdtemp(prefix="ttsray-")
    port = free_port()
    try:
        ray.init(
            num_cpus=2,
            num_gpus=0,
            include_dashboard=True,  # Ray's state API (replica actor pids) is served by the dashboard
            dashboard_port=free_port(),
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TMPDIR": run_root}},
        )
    except Exception as e:  # noqa: BLE001 - whatever keeps Ray from starting here is the skip reason
        pytest.skip(f"a local Ray instance cannot start here: {type(e).__name__}: {e}")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield RayApp(f"http://127.0.0.1:{port}", run_root)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(run_root, ignore_errors=True)


@pytest.fixture
def ray_app(ray_cluster: RayApp) -> RayApp:
    """Two running replicas (deployed once; again only if a test deleted the app)."""
    if APP not in serve.status().applications:
        ray_cluster.deploy()
    ray_cluster.wait_running(120)
    return ray_cluster


def _speak(url: str, i: int, body: dict, seen: dict | None = None) -> dict:
    """One streamed request: its status, its replica (X-Replica, also put in `seen` as soon as the response
    starts), its audio size, or the error that ended it."""
    out: dict = {"i": i}
    body = {"input": f"Hello number {i}.", "seed": i, **body}
    try:
        with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=60) as r:
            out.update(code=r.status_code, replica=r.headers.get("x-replica"))
            if seen is not None:
                seen[i] = out["replica"]
            data = b"".join(r.iter_bytes())
            out.update(size=len(data), body=data[:300] if r.status_code != 200 else b"")
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


SHORT = {**LONG, "min_new_tokens": 40, "max_new_tokens": 40}


def _spread(url: str, replicas: set[str], timeout_s: float = 30) -> list[dict]:
    """Batches of 4 concurrent requests until every replica in `replicas` answered one (Ray's router picks
    replicas at random, weighted by their queues); every request must succeed. Returns all results."""
    results: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while {r["replica"] for r in results} != replicas and time.monotonic() < deadline:
        with ThreadPoolExecutor(4) as pool:
            batch = list(pool.map(lambda i: _speak(url, i, SHORT), range(len(results), len(results) + 4)))
        assert all(r.get("code") == 200 and r["size"] > 0 and "error" not in r for r in batch), batch
        results += batch
    assert {r["replica"] for r in results} == replicas, results
    return results


def test_two_replicas_share_the_requests(ray_app: RayApp) -> None:
    results = _spread(ray_app.url, set(ray_app.replicas()))
    assert len({r["size"] for r in results}) == 1  # 40 frames each
    assert len(ray_app.run_dirs()) == 2  # one engine core per replica
    # The same app as `ttsserve serve`: OpenAI-shaped errors come through Ray's proxy unchanged.
    r = httpx.post(ray_app.url + "/v1/audio/speech", json={"model": "chattts", "voice": "alloy"}, timeout=30)
    assert r.status_code == 400 and "input" in json.dumps(r.json()["error"])


def _core_pid(actor_pid: int) -> int:
    """The engine-core process among the replica process's children (not multiprocessing's resource tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == actor_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError(f"no engine core under replica process {actor_pid}")


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.parametrize("victim", ["replica", "core"])
def test_a_killed_replica_fails_only_its_streams_and_is_replaced(ray_app: RayApp, victim: str) -> None:
    replicas = ray_app.replicas()
    seen: dict[int, str] = {}
    with ThreadPoolExecutor(14) as pool:
        batch = [pool.submit(_speak, ray_app.url, i, LONG, seen) for i in range(8)]
        _wait(lambda: len(seen) == 8, 60, "the batch did not start")
        assert not any(f.done() for f in batch), "streams finished before the kill: make them longer"
        target = seen[0]
        pid = replicas[target] if victim == "replica" else _core_pid(replicas[target])
        os.kill(pid, signal.SIGKILL)
        # requests arriving now are not running anywhere yet: Ray routes them to a live replica (a replica
        # whose core died answers 503 engine_dead until its failed health check takes it out)
        after = [pool.submit(_speak, ray_app.url, 100 + i, SHORT) for i in range(6)]
        results = [f.result(timeout=120) for f in batch]  # none hangs
        late = [f.result(timeout=120) for f in after]

    killed = [r for r in results if r["replica"] == target]
    assert killed and all("incomplete" in r.get("error", "") for r in killed), killed  # a cut stream
    survivors = [r for r in results if r["replica"] != target]
    assert all("error" not in r and r["code"] == 200 for r in survivors), survivors
    assert len({r["size"] for r in survivors}) <= 1 and all(r["size"] > 0 for r in survivors)  # complete
    for r in late:
        engine_dead = victim == "core" and r.get("code") == 503 and b"engine_dead" in r["body"]
        assert engine_dead or ("error" not in r and r["code"] == 200 and r["replica"] != target), r
    print(f"{victim} killed: {len(killed)} of {len(results)} streams cut, {len(survivors)} completed")

    _spread(ray_app.url, set(ray_app.wait_running(90, gone=target)))  # Ray replaced it; both serve again
    _wait(lambda: len(ray_app.run_dirs()) == 2, 30, f"run directories: {ray_app.run_dirs()}")


def test_deleting_the_app_stops_every_core(ray_app: RayApp) -> None:
    cores = [_core_pid(pid) for pid in ray_app.replicas().values()]
    serve.delete(APP)
    _wait(lambda: not any(Path(f"/proc/{p}").exists() for p in cores), 60, f"engine cores left: {cores}")
    assert ray_app.run_dirs() == []
