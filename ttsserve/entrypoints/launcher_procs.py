"""The processes the launcher (api_servers.py) spawns: the engine core and the API servers. Each child gets
its own process group (terminal signals go to the launcher, which orders the shutdown) and dies with the
launcher even if it is SIGKILLed."""

from __future__ import annotations

import logging
import os
import socket
import sys

_LOG_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


def _configure_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), format=_LOG_FORMAT.format(role=role), stream=sys.stderr)


def _child_setup(parent_pid: int, log_level: str, role: str) -> None:
    from ttsserve.engine.core.parent_death import die_with_parent

    os.setpgrp()  # terminal signals go to the launcher, which orders the shutdown
    die_with_parent(parent_pid)
    _configure_logging(log_level, role)


# ---- the children ----------------------------------------------------------------------------------
def _core_main(
    engine_cfg,
    address: str,
    ready,
    drain_timeout_s: float,
    log_level: str,
    parent_pid: int,
    heartbeat,
    env: dict[str, str],
    index: int,
) -> None:
    os.environ.update(env)  # its GPU (CUDA_VISIBLE_DEVICES) or thread count, before torch loads
    _child_setup(parent_pid, log_level, f"core{index}")
    from ttsserve.runner.cpu_threads import openmp_env_defaults

    openmp_env_defaults()  # before torch loads (the next import): idle OpenMP threads must sleep, not spin
    from ttsserve.engine.core.proc import run_engine_core
    from ttsserve.server.args import server_cpu_defaults

    server_cpu_defaults(engine_cfg)
    sys.exit(run_engine_core(engine_cfg, address, ready, drain_timeout_s, heartbeat))


def _api_server_main(
    index: int,
    sock: socket.socket,
    server_cfg,
    core_addresses: list[str],
    limits_address: str | None,
    log_level: str,
    parent_pid: int,
) -> None:
    _child_setup(parent_pid, log_level, f"api{index}")
    from ttsserve.server.http_server import raise_fd_limit, uvicorn_config

    raise_fd_limit()
    from ttsserve.engine.core.dp_client import DPClient
    from ttsserve.server.app import create_app
    from ttsserve.server.drain import DrainingServer

    rate = None
    if limits_address is not None:
        from ttsserve.server.shared_limits import SharedRateLimiter

        rate = SharedRateLimiter(limits_address)
    # started with the cores: the launcher watches them load (and stops everything if one fails), so wait
    client = DPClient(core_addresses, index, server_cfg.engine_stall_timeout_s, handshake_timeout_s=None)
    app = create_app(client, server_cfg, rate_limiter=rate)
    from ttsserve.engine.core.heap import freeze_startup_heap

    freeze_startup_heap(f"API server {index}")
    config = uvicorn_config(ApiServerHeader(app, index), server_cfg, log_level)
    DrainingServer(config, app.state.drain, server_cfg.drain_timeout_s).run(sockets=[sock])


class ApiServerHeader:
    """Pure ASGI: `X-API-Server: <index>` on every response, so logs and clients can tell which process answered."""

    def __init__(self, app, index: int) -> None:
        self.app = app
        self.header = (b"x-api-server", str(index).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(msg) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), self.header]}
            await send(msg)

        await self.app(scope, receive, send_with_header)
