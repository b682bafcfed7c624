"""ttsserve on Ray Serve: a fleet of engines (one per GPU) across machines, autoscaled on queue depth.

    serve run ttsserve.deploy.ray:app                                        # settings from TTSSERVE_* env
    serve run ttsserve.deploy.ray:build_app model=/models/chattts min_replicas=2 max_replicas=8
    serve run ttsserve.deploy.ray:build_app load_format=dummy dummy_size=tiny device=cpu num_replicas=2 num_gpus=0

Each replica is one Ray actor (one GPU: `num_gpus=1`, Ray sets CUDA_VISIBLE_DEVICES, which its engine-core
process inherits) running what `ttsserve serve --api-server-count 1` runs: one engine-core process
(engine/core/proc.py, started by deploy/core_process.py) and the same FastAPI app as `ttsserve serve` (OpenAI
/v1/audio/speech, /synthesize, streaming, voices, /metrics) around a CoreClient connected to it, behind Ray's
HTTP proxy. Every response carries `X-Replica: <replica id>`. Arguments: every `ttsserve serve` flag as
`name=value` (dashes or underscores), plus the Ray settings in RAY_KEYS. Requires `pip install "ray[serve]"`;
importing this module without Ray raises ImportError.

Autoscaling: Ray counts ongoing requests per replica (queued + streaming), which for a TTS engine is its queue
depth; it adds replicas while the average stays above `target_ongoing_requests` (default 16: a batched engine
is efficient with many streams in flight, unlike Ray's default of 2) and removes them after
`downscale_delay_s` below it. Ray's custom autoscaling policies (engine metrics through
`record_autoscaling_stats`) are an alpha API, and would measure the same queue. `max_ongoing_requests` caps
what one replica accepts; beyond it Ray queues in the proxy, and the engine's own queue bound (503) stays the
last line.

Health: Ray calls `check_health` every `health_check_period_s`; it fails exactly when the app's /ready answers
503, e.g. once the engine core died or stalled (the core is not restarted in place), and Ray replaces the
replica. A replica process that dies takes its core with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from ray import serve

from ttsserve.config import EngineConfig

# Ray settings accepted by build_app (defaults in parentheses in the docs): name -> converter.
RAY_KEYS = {
    "num_replicas": str,  # an int, or "auto" for autoscaling between min_replicas and max_replicas (auto)
    "min_replicas": int,
    "max_replicas": int,
    "target_ongoing_requests": float,
    "max_ongoing_requests": int,
    "upscale_delay_s": float,
    "downscale_delay_s": float,
    "num_gpus": float,
    "num_cpus": float,
    "health_check_period_s": float,
    "health_check_timeout_s": float,
    "name": str,
}
RAY_DEFAULTS: dict[str, Any] = {
    "num_replicas": "auto",
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 16.0,
    "max_ongoing_requests": 64,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 300.0,
    "num_cpus": 1.0,
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "name": "ttsserve",
}


class ReplicaUnhealthyError(RuntimeError):
    """check_health's failure: the replica's /ready would answer 503 (Ray replaces the replica)."""


@serve.ingress()
class TTSServeReplica:
    """One engine-core process + the HTTP app around a CoreClient connected to it. The core loads the model in
    the constructor; the client connects in the app's lifespan, which Ray runs before the replica takes
    traffic. Shutdown (Ray's graceful stop): the app drains its streams and closes the client, then `__del__`
    stops the core."""

    def __init__(self, engine_cfg: EngineConfig, server_cfg: Any, log_level: str = "info") -> None:
        from ttsserve.deploy.core_process import EngineCoreProcess
        from ttsserve.engine.core.client import CoreClient

        # Ray runs the constructor on the replica's user-code thread, which lives as long as the actor: the
        # core's owner-death signal is tied to it (core_process's contract).
        self._core = EngineCoreProcess(engine_cfg, server_cfg.drain_timeout_s, log_level)
        self._core.start()
        self._client = CoreClient(self._core.address, 0, stall_timeout_s=server_cfg.engine_stall_timeout_s)
        self._server_cfg = server_cfg
        self._app = None
        self._replica_id = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        from ttsserve.server.app import create_app

        self._app = create_app(self._client, self._server_cfg)
        from ttsserve.server.http_server import ResponseHeader

        self._app.add_middleware(ResponseHeader, name="X-Replica", value=self._replica_id)
        return self._app

    def check_health(self) -> None:
        """Raises exactly when the app's /ready answers 503: the core is gone or stalled (the client's
        dead_reason), the client is not connected, or the app is shutting down."""
        client = self._client
        closing = self._app is not None and self._app.state.server.gate.closed
        if not client.ready or closing:
            raise ReplicaUnhealthyError((client.dead_reason if client.dead else None) or "engine not ready")

    def __del__(self) -> None:
        # After the app's lifespan shutdown the client has drained: a live core is idle and stops at once on
        # SIGTERM. A dead or stalled one is killed without waiting: Ray's shutdown budget is short, and a
        # stalled loop never acts on SIGTERM.
        core, client = getattr(self, "_core", None), getattr(self, "_client", None)
        if core is not None:
            core.stop(timeout_s=0.0 if client is None or client.dead else None)


_BOOL_FIELDS = {f.name for f in dataclasses.fields(EngineConfig) if str(f.type) == "bool"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _serve_args(args: dict[str, Any]) -> list[str]:
    """{"load_format": "dummy", "enforce_eager": "true"} -> ["--load-format", "dummy", "--enforce-eager"].
    Boolean engine settings take true/false (as `serve run` passes strings) and become --x / --no-x."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        text = str(value).strip().lower()
        if key in _BOOL_FIELDS:
            if text not in _TRUE + _FALSE:
                raise ValueError(f"{key}={value!r}: expected true or false")
            out.append(flag if text in _TRUE else "--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def split_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Ray settings with defaults filled in, the `ttsserve serve` settings). ValueError for a bad Ray value."""
    args = {k.replace("-", "_"): v for k, v in (args or {}).items()}
    ray_opts = dict(RAY_DEFAULTS)
    serve_opts = {}
    for key, value in args.items():
        if key in RAY_KEYS:
            try:
                ray_opts[key] = RAY_KEYS[key](value)
            except ValueError:
                raise ValueError(f"{key}={value!r}: expected {RAY_KEYS[key].__name__}") from None
        else:
            serve_opts[key] = value
    return ray_opts, serve_opts


def deployment_options(ray_opts: dict[str, Any], engine_cfg: EngineConfig, drain_timeout_s: float) -> dict:
    """The `serve.deployment(...).options(...)` keyword arguments."""
    num_gpus = ray_opts.get("num_gpus")
    if num_gpus is None:  # one GPU per replica unless the engine runs on the CPU
        num_gpus = 0.0 if engine_cfg.device == "cpu" else 1.0
    opts: dict[str, Any] = {
        "name": ray_opts["name"],
        "max_ongoing_requests": ray_opts["max_ongoing_requests"],
        "ray_actor_options": {"num_gpus": num_gpus, "num_cpus": ray_opts["num_cpus"]},
        "health_check_period_s": ray_opts["health_check_period_s"],
        "health_check_timeout_s": ray_opts["health_check_timeout_s"],
        "graceful_shutdown_timeout_s": drain_timeout_s + 5.0,
    }
    if str(ray_opts["num_replicas"]) == "auto":
        if not 1 <= ray_opts["min_replicas"] <= ray_opts["max_replicas"]:
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        opts["autoscaling_config"] = {
            "min_replicas": ray_opts["min_replicas"],
            "max_replicas": ray_opts["max_replicas"],
            "initial_replicas": ray_opts["min_replicas"],
            "target_ongoing_requests": ray_opts["target_ongoing_requests"],
            "upscale_delay_s": ray_opts["upscale_delay_s"],
            "downscale_delay_s": ray_opts["downscale_delay_s"],
        }
    else:
        n = int(ray_opts["num_replicas"])
        if n < 1:
            raise ValueError(f"num_replicas must be >= 1 or 'auto', got {n}")
        opts["num_replicas"] = n
    return opts


def build_app(args: dict[str, Any] | None = None):
    """The Ray Serve application (`serve run ttsserve.deploy.ray:build_app key=value ...`).
    Engine and server settings are validated here, on the driver, before any replica starts."""
    from ttsserve.server.args import add_serve_arguments, build_configs

    ray_opts, serve_opts = split_args(args or {})
    if "voices_db" not in serve_opts and not os.environ.get("TTSSERVE_VOICES_DB"):
        # Replicas may run on machines without the driver's home folder; a voice store per replica would also
        # disagree between replicas. Seed and speaker-string voices are stateless and work fleet-wide.
        serve_opts["voices_db"] = ":memory:"
    parser = add_serve_arguments(argparse.ArgumentParser(prog="ttsserve.deploy.ray", add_help=False))
    ns = parser.parse_args(_serve_args(serve_opts))
    engine_cfg, server_cfg, _host, _port, log_level = build_configs(ns, env=dict(os.environ))
    opts = deployment_options(ray_opts, engine_cfg, server_cfg.drain_timeout_s)
    return serve.deployment(TTSServeReplica).options(**opts).bind(engine_cfg, server_cfg, log_level)


def __getattr__(name: str):
    # `serve run ttsserve.deploy.ray:app` reads this attribute; building it lazily keeps importing the module
    # free of side effects (and of errors from a bad TTSSERVE_* variable).
    if name == "app":
        return build_app()
    raise AttributeError(name)
