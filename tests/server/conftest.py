"""A real uvicorn server on loopback (in a thread, on a socket bound to a free port) around a given app."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tests.server.fake_engine import FakeEngine
from ttsserve.config import EngineConfig
from ttsserve.server.app import ServerConfig, create_app

# The real engine on random tiny weights, CPU, a small KV pool and no swap space (fast to build).
REAL_ENGINE = {
    "load_format": "dummy",
    "dummy_size": "tiny",
    "dtype": "float32",  # the fp32 parity path on every machine (auto picks bf16 where the CPU has it)
    "device": "cpu",
    "kv_cache_memory": 64 << 20,
    "swap_space": 0.0,
}
# The dummy's EOS comes after some 5-10 frames per prompt position (model/dummy_eos.py): cap every segment so each
# synthesis is a few hundred ms of CPU (tests that need the full 24 frames also set min_new_tokens).
REAL_MAX_NEW_TOKENS = 24


def make_real_engine(**overrides):
    from ttsserve.engine.core.async_engine import AsyncEngine

    return AsyncEngine.from_config(EngineConfig(**{**REAL_ENGINE, **overrides}))


class LiveServer:
    def __init__(self, app, graceful_s: float = 10.0) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", access_log=False, timeout_graceful_shutdown=graceful_s
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, wait: bool = True) -> None:
        self.server.should_exit = True
        if wait:
            self.thread.join(30)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kw)


@pytest.fixture
def serve():
    """serve(engine=None, **ServerConfig fields) -> (LiveServer, engine); stopped after the test."""
    servers: list[LiveServer] = []

    def _serve(engine=None, **cfg):
        engine = engine or FakeEngine()
        srv = LiveServer(create_app(engine, ServerConfig(**cfg))).start()
        servers.append(srv)
        return srv, engine

    yield _serve
    for srv in servers:
        srv.stop()


@pytest.fixture
def serve_real(serve):
    """serve_real(engine_overrides=None, **ServerConfig fields) -> (LiveServer, AsyncEngine) on tiny weights."""

    def _serve(engine_overrides: dict | None = None, **cfg):
        cfg.setdefault("max_new_tokens", REAL_MAX_NEW_TOKENS)
        return serve(make_real_engine(**(engine_overrides or {})), **cfg)

    return _serve


def wait_until(pred, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
