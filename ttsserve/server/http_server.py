"""The one place the HTTP server (uvicorn) is configured, for the single process and for each API server.

    config = uvicorn_config(app, server_cfg, log_level)
    uvicorn.Server(config).run(sockets=[sock])

Connection limits and timeouts are server/connections.py's; raise_fd_limit() runs once at start.
"""

from __future__ import annotations

import logging
import os

from ttsserve.server.connections import LINGER_MAX, protocol_class

logger = logging.getLogger("ttsserve.server")

# File descriptors kept free of connections: the process's own (model files, ZMQ, SQLite, logs, the
# metrics directory) and connections lingering until their 503 or 408 is read.
FD_RESERVE = 64 + LINGER_MAX


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one (each connection is a file descriptor; a default soft
    limit of 1,024 is a thousand clients). Logs the limit; returns it. Children inherit it."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            logger.info("open-file limit raised from %d to %d (the hard limit)", soft, hard)
            return hard
        except (ValueError, OSError) as e:
            logger.warning("open-file limit %d: could not raise it to %d (%s)", soft, hard, e)
            return soft
    logger.info("open-file limit: %d", soft)
    return soft


def default_max_connections() -> int:
    """Connections one process can hold below its fd limit: the soft limit less what is open now and a reserve."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    return max(1, soft - open_now - FD_RESERVE)


def resolve_max_connections(configured: int | None) -> int:
    """--max-connections, or the fd-limit default; warns when the configured cap cannot fit the fd limit."""
    fit = default_max_connections()
    if configured is None:
        return fit
    if configured > fit:
        logger.warning(
            "--max-connections %d exceeds the %d this process's open-file limit leaves room for: past that, "
            "connections are reset by the kernel instead of answered 503 (raise `ulimit -n`)",
            configured,
            fit,
        )
    return configured


def uvicorn_config(app, server_cfg, log_level: str):
    """uvicorn.Config for `app` under ServerConfig's connection settings (timeouts, cap, drain)."""
    import uvicorn

    cap = resolve_max_connections(server_cfg.max_connections)
    logger.info(
        "connections: at most %d open (more get 503), header timeout %g s, body timeout %g s, keep-alive %g s",
        cap,
        server_cfg.header_timeout_s,
        server_cfg.body_timeout_s,
        server_cfg.timeout_keep_alive_s,
    )
    # Our own JSON access log replaces uvicorn's; graceful shutdown waits for streams up to the drain timeout.
    return uvicorn.Config(
        app,
        http=protocol_class(server_cfg.header_timeout_s, server_cfg.body_timeout_s, cap),
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_keep_alive=server_cfg.timeout_keep_alive_s,
        timeout_graceful_shutdown=server_cfg.drain_timeout_s,
    )


class ResponseHeader:
    """Pure ASGI middleware: one fixed header on every HTTP response (`X-API-Server: <i>`, `X-Replica: <id>`),
    so logs and clients can tell which process answered."""

    def __init__(self, app, name: str, value: str) -> None:
        self.app = app
        self.header = (name.lower().encode(), value.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(msg) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), self.header]}
            await send(msg)

        await self.app(scope, receive, send_with_header)
