"""The processes the launcher (api_servers.py) spawns: the engine core and the API servers. Each child gets
its own process group (terminal signals go to the launcher, which orders the shutdown) and dies with the
launcher even if it is SIGKILLed."""

from __future__ import annotations

import logging
import os
import socket
import sys

from ttsserve.engine.core.launch import LOG_FORMAT


def _configure_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT.format(role=role), stream=sys.stderr)


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
    go=None,
) -> None:
    os.environ.update(env)  # its GPU (CUDA_VISIBLE_DEVICES) or thread count, before torch loads
    os.setpgrp()  # terminal signals go to the launcher, which orders the shutdown
    from ttsserve.engine.core.launch import core_process_main

    role = f"core{index}"
    core_process_main(engine_cfg, address, ready, drain_timeout_s, log_level, parent_pid, role, heartbeat, go=go)


def _api_server_main(
    index: int,
    sock: socket.socket,
    server_cfg,
    core_addresses: list[str],
    limits_address: str | None,
    log_level: str,
    parent_pid: int,
    drained,
) -> None:
    """drained: the API servers' shared drain flags (server/drain.py DrainGroup)."""
    _child_setup(parent_pid, log_level, f"api{index}")
    from ttsserve.server.http_server import ResponseHeader, raise_fd_limit, uvicorn_config

    raise_fd_limit()
    from ttsserve.engine.core.dp_client import DPClient
    from ttsserve.server.app import create_app
    from ttsserve.server.drain import DrainGroup, DrainingServer

    rate = None
    if limits_address is not None:
        from ttsserve.server.shared_limits import SharedRateLimiter

        rate = SharedRateLimiter(limits_address)
    # started with the cores: the launcher watches them load (and stops everything if one fails), so wait
    client = DPClient(core_addresses, index, server_cfg.engine_stall_timeout_s, handshake_timeout_s=None)
    app = create_app(client, server_cfg, rate_limiter=rate)
    from ttsserve.engine.core.heap import freeze_startup_heap

    freeze_startup_heap(f"API server {index}")
    config = uvicorn_config(ResponseHeader(app, "X-API-Server", str(index)), server_cfg, log_level)
    group = DrainGroup(drained, index)  # the API servers drain together (server/drain.py)
    DrainingServer(config, app.state.drain, server_cfg.drain_timeout_s, group).run(sockets=[sock])
