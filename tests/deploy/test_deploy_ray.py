"""Ray Serve deployment (ttsserve/deploy/ray.py): options from `serve run ... key=value` arguments, and a real
local Ray instance serving two tiny CPU replicas over HTTP. Skips when ray[serve] is not installed."""

from __future__ import annotations

import json
import os
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from deploy_helpers import ROOT, free_port

serve = pytest.importorskip("ray.serve", reason="ray[serve] not installed (pip install 'ray[serve]')")
ray_deploy = pytest.importorskip("ttsserve.deploy.ray")

TINY = {
    "load_format": "dummy",
    "dummy_size": "tiny",
    "dtype": "float32",
    "device": "cpu",
    "kv_cache_memory": "64M",
    "swap_space": 0,
}


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


def test_check_health_fails_when_the_engine_loop_is_dead() -> None:
    check = ray_deploy.TTSServeReplica.check_health
    check(types.SimpleNamespace(_engine=types.SimpleNamespace(ready=True)))
    with pytest.raises(RuntimeError, match="not running"):
        check(types.SimpleNamespace(_engine=types.SimpleNamespace(ready=False)))


@pytest.fixture(scope="module")
def ray_app():
    import ray

    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")  # replica workers
    port = free_port()
    ray.init(
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_deploy.build_app({**TINY, "num_replicas": 2, "num_cpus": 0.5})
        serve.run(app, name="ttsserve", route_prefix="/", blocking=False)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_cpu_replicas_serve_speech(ray_app: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(ray_app + "/ready", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    status = serve.status().applications["ttsserve"].deployments["ttsserve"]
    assert dict(status.replica_states) == {"RUNNING": 2}

    def speak(i: int) -> tuple[int, int, str]:
        body = {
            "model": "chattts",
            "input": f"Hello number {i}.",
            "voice": "alloy",
            "response_format": "pcm",
            "seed": i,
            "max_new_tokens": 40,
        }
        with httpx.stream("POST", ray_app + "/v1/audio/speech", json=body, timeout=60) as r:
            data = b"".join(r.iter_bytes())
            return r.status_code, len(data), r.headers.get("content-type", "")

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(speak, range(4)))
    assert all(code == 200 and size > 0 and size % 2 == 0 for code, size, _ in results), results
    # The same app as `ttsserve serve`: OpenAI-shaped errors come through Ray's proxy unchanged.
    r = httpx.post(ray_app + "/v1/audio/speech", json={"model": "chattts", "voice": "alloy"}, timeout=30)
    assert r.status_code == 400 and "input" in json.dumps(r.json()["error"])
