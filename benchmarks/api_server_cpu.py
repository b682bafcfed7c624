"""CPU an API server process spends per request and per second of audio it streams, with the HTTP parser and
event loop the install has (httptools + uvloop when importable) or with uvicorn's pure-Python fallbacks (h11 +
asyncio, `--fallbacks`: both modules hidden from the server's processes).

Starts `ttsserve serve --api-server-count 1` (tiny dummy model on the CPU unless other serve flags follow --),
sends --requests streamed /v1/audio/speech requests, --concurrency at a time, reading every byte, and reads
the API server's and the engine core's CPU seconds from /proc before and after. One JSON line.

    python3 benchmarks/api_server_cpu.py [--fallbacks] [--requests 200] [--concurrency 8] [--format pcm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hide(names: list[str]) -> str:
    """A directory whose modules of those names fail to import (uvicorn then falls back)."""
    d = tempfile.mkdtemp(prefix="hide-")
    for name in names:
        Path(d, f"{name}.py").write_text(f"raise ImportError('{name} hidden by api_server_cpu.py')\n")
    return d


async def _drive(url: str, n: int, concurrency: int, fmt: str) -> tuple[int, float]:
    body = {"model": "chattts", "input": TEXT, "voice": "alloy", "response_format": fmt}
    todo, total = iter(range(n)), 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        for _ in todo:
            async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200, r.status_code
                async for chunk in r.aiter_bytes():
                    total += len(chunk)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fallbacks", action="store_true", help="hide httptools and uvloop from the server")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--format", default="pcm")
    ap.add_argument("serve_args", nargs="*", default=["--device", "cpu", "--dummy-size", "tiny"])
    a = ap.parse_args()
    port, env = _free_port(), dict(os.environ)
    if a.fallbacks:
        env["PYTHONPATH"] = os.pathsep.join([_hide(["httptools", "uvloop"]), str(REPO)])
    cmd = [sys.executable, "-m", "ttsserve.entrypoints.cli", "serve", "--port", str(port), "--api-server-count", "1"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd + a.serve_args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                sys.exit(f"server exited: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        text = Path(log.name).read_text()
        api_pid = int(re.search(r"API server 0: pid (\d+)", text).group(1))
        core_pid = int(re.search(r"engine core 0: pid (\d+)", text).group(1))
        asyncio.run(_drive(url, 8, 8, a.format))  # warm-up
        before = _cpu_s(api_pid), _cpu_s(core_pid)
        nbytes, wall = asyncio.run(_drive(url, a.requests, a.concurrency, a.format))
        api_s, core_s = _cpu_s(api_pid) - before[0], _cpu_s(core_pid) - before[1]
        audio_s = nbytes / 2 / 24000 if a.format == "pcm" else float("nan")
        parser = "h11 + asyncio" if a.fallbacks else "httptools + uvloop (as installed)"
        print(
            json.dumps(
                {
                    "server": parser,
                    "requests": a.requests,
                    "concurrency": a.concurrency,
                    "wall_s": round(wall, 2),
                    "api_cpu_ms_per_request": round(api_s / a.requests * 1e3, 2),
                    "api_cpu_per_audio_s": round(api_s / audio_s, 4),
                    "core_cpu_ms_per_request": round(core_s / a.requests * 1e3, 2),
                    "audio_s": round(audio_s, 1),
                }
            )
        )
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
