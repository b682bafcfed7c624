"""An API server pays its one-time costs before it serves (server/warm_start.py): in a fresh interpreter, the
first request after the app's start-up imports no module, while without the warm-up it imports anyio's
asyncio backend and numpy.random (the check can fail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import asyncio, json, sys
sys.path.insert(0, {here!r})
import httpx
from fake_engine import FakeEngine
import ttsserve.server.app as app_mod

async def main(warm, fmt):
    if not warm:
        async def skip(state):
            return 0.0
        app_mod.warm_up_api_server = skip
    app = app_mod.create_app(FakeEngine())
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            await c.get("/health")  # the test transport's own first-use imports
            before = set(sys.modules)
            r = await c.post("/v1/audio/speech", json={{"model": "chattts", "input": "Hello there.",
                                                         "voice": "alloy", "response_format": fmt}})
            assert r.status_code == 200, r.text
            print(json.dumps(sorted(set(sys.modules) - before)))

asyncio.run(main(sys.argv[1] == "warm", sys.argv[2]))
"""


def _first_request_imports(warm: bool, fmt: str) -> list[str]:
    code = _PROBE.format(here=str(Path(__file__).resolve().parent))
    out = subprocess.run(
        [sys.executable, "-c", code, "warm" if warm else "cold", fmt],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", ["mp3", "pcm"])
def test_the_first_request_of_a_warmed_api_server_imports_nothing(fmt):
    assert _first_request_imports(True, fmt) == []


def test_without_the_warm_up_the_first_request_imports_the_lazy_modules():
    cold = _first_request_imports(False, "pcm")
    assert "anyio._backends._asyncio" in cold and "numpy.random" in cold, cold
