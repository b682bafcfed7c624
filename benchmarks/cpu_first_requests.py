"""The first requests a CPU user sends: seconds from `serve` start to /ready, then the first N requests of one
short text (100 frames, about 2.1 s of audio), one after the other (wall time, time to the first byte, audio s).

    python benchmarks/cpu_first_requests.py --mode eager --log /tmp/s.log -- --device cpu --dummy-size real
    python benchmarks/cpu_first_requests.py --mode background --cold-cache --log /tmp/s.log -- --device cpu ...
    python benchmarks/cpu_first_requests.py --mode warm --cold-cache --log /tmp/s.log -- --device cpu ...

--concurrency N: each of the requests is N streams sent at once (one JSON object per stream, in a list).
--mode eager: $TTSSERVE_CPU_COMPILE=0 (no compile). --mode background: $TTSSERVE_CPU_COMPILE=1 (the compile runs
after /ready, the eager path serves meanwhile); requests go at /ready. --mode warm: the same server, but the first
request waits for the log line that says the compile landed: what a compile before /ready gives. One JSON line
per run on stdout.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import wave

import httpx

TEXT = "Hello! This is a short test of the speech server on a CPU."
FRAMES = 100  # about 2.1 s of audio
COMPILED = "CPU decode step compiled in"  # runner/cpu_graph.py's log line: the compile landed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode})")
        try:
            if pred():
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout_s} s")


def one_request(client: httpx.Client, seed: int) -> dict:
    body = {"model": "chattts", "input": TEXT, "voice": "alloy", "response_format": "wav", "seed": seed}
    body |= {"min_new_tokens": FRAMES, "max_new_tokens": FRAMES}  # the same length every time, on any weights
    t0 = time.perf_counter()
    first = None
    buf = io.BytesIO()
    with client.stream("POST", "/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if first is None and chunk:
                first = time.perf_counter() - t0
            buf.write(chunk)
    wall = time.perf_counter() - t0
    data = buf.getvalue()
    with wave.open(io.BytesIO(data)) as w:
        frames = w.getnframes()
        rate = w.getframerate()
    if frames in (0, 0x7FFFFFFF) or frames * w.getsampwidth() > len(data):  # a streamed header: count the bytes
        frames = (len(data) - 44) // 2
    audio = frames / rate
    return {"wall_s": round(wall, 2), "ttfb_s": round(first or wall, 2), "audio_s": round(audio, 2)}


def concurrent_requests(client: httpx.Client, n: int) -> list[dict]:
    """n streams at once (seeds 1234 + i), each with its own timings."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: one_request(client, seed=1234 + i), range(n)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("background", "warm", "eager"), required=True)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=1, help="streams sent at once per request")
    ap.add_argument("--log", required=True, help="the server's log (read for the compile's line)")
    ap.add_argument("--cold-cache", action="store_true", help="a fresh inductor cache (a first start, not a restart)")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    serve_args = [x for x in a.serve_args if x != "--"]
    port = free_port()
    env = dict(os.environ)
    env.pop("TTSSERVE_CPU_COMPILE", None)
    if a.mode == "eager":
        env["TTSSERVE_CPU_COMPILE"] = "0"
    if a.cold_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    cmd = [sys.executable, "-m", "ttsserve.entrypoints.cli", "serve", *serve_args, "--port", str(port)]
    with open(a.log, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
                ready = wait_for(lambda: c.get("/ready").status_code == 200, proc, 900) - t0
                out = {"mode": a.mode, "cold_cache": a.cold_cache, "ready_s": round(ready, 1)}
                if a.mode == "warm":
                    warm = wait_for(lambda: COMPILED in open(a.log).read(), proc, 900)
                    out["warm_s"] = round(warm - t0, 1)
                if a.concurrency == 1:
                    out["requests"] = [one_request(c, seed=1234) for _ in range(a.requests)]
                else:
                    out["concurrency"] = a.concurrency
                    out["requests"] = [concurrent_requests(c, a.concurrency) for _ in range(a.requests)]
                if a.mode == "background":
                    out["warm_after_requests"] = COMPILED in open(a.log).read()
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if a.cold_cache:
                shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
