"""Data-parallel engine cores on this CPU: the scale-out targets, measured in one run (tiny model, one thread per
core, one API server, loopback, closed-loop pcm streams).

    python3 benchmarks/dp_cpu.py --out benchmarks/results/dp-cpu.json [--duration 30] [--concurrency 16]

1. scaling: audio-s/s with 2 cores against 1 core at the same concurrency (target >= 1.7x), and with 2 cores
   at twice the concurrency (each core as loaded as the one core was);
2. mixed load, 2 cores: a quarter of the requests 10x longer; /metrics sampled every 100 ms: samples where
   a core idles (nothing running, nothing waiting) while the other has waiting requests (target 0), and
   time-to-first-audio p99 against the uniform load's (target <= 1.3x);
3. kill -9 of core 1 under load: requests that fail (only those core 1 held may), requests served meanwhile by
   core 0, and the seconds until core 1 is back in /ready.
Run it on an otherwise idle machine: the cores, the API server and this load generator share its CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.prom_util import metric  # noqa: E402

TINY = ["--load-format", "dummy", "--dummy-size", "tiny", "--dtype", "float32", "--device", "cpu"]
SHORT, LONG = 60, 600  # frames of a uniform request and of a long one (10x)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cores: int, log: Path, extra: list[str] = ()) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ttsserve.entrypoints.serve", *TINY, "--port", str(self.port)]
        cmd += ["--kv-cache-memory", "128M", "--swap-space", "0", "--voices-db", ":memory:"]
        cmd += ["--data-parallel-size", str(cores), "--api-server-count", "1", "--max-new-tokens", str(LONG)]
        cmd += list(extra)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # one thread per core
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.cores = cores

    def ready_cores(self) -> list[dict]:
        try:
            r = httpx.get(self.url + "/ready", timeout=2)
            return r.json()["cores"] if r.status_code == 200 else []
        except (httpx.TransportError, ValueError, KeyError):
            return []

    def wait(self, timeout_s: float = 180) -> None:
        t0 = time.monotonic()
        while sum(c["ready"] for c in self.ready_cores()) < self.cores:
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"server did not come up; see {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client: httpx.AsyncClient, i: int, frames: int) -> dict:
    body = {"model": "chattts", "voice": "alloy", "response_format": "pcm", "stream": True}
    body |= {"input": f"Request {i} reads a sentence aloud.", "min_new_tokens": frames, "max_new_tokens": frames}
    t0 = time.perf_counter()
    ttfa, n = None, 0
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "why": r.status_code, "t": t0}
            async for chunk in r.aiter_bytes():
                ttfa = ttfa if ttfa is not None or not chunk else time.perf_counter() - t0
                n += len(chunk)
    except httpx.HTTPError as e:
        return {"ok": False, "why": type(e).__name__, "t": t0}
    ok = n >= (frames - 1) * 512 * 2
    return {"ok": ok, "why": None if ok else "short", "ttfa": ttfa, "audio_s": n / 2 / 24000, "t": t0}


async def _load(url: str, concurrency: int, duration: float, long_every: int = 0) -> list[dict]:
    """Closed loop: `concurrency` workers, each sending its next request when the last one ends."""
    out: list[dict] = []
    counter = iter(range(10**9))
    stop = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while time.perf_counter() < stop:
                i = next(counter)
                long = long_every and i % long_every == 0
                out.append(await _one(client, i, LONG if long else SHORT))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def _sample(url: str, cores: int, stop: asyncio.Event, every_s: float = 0.1) -> list[dict]:
    """Per-core running / waiting every `every_s` s."""
    samples = []
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while not stop.is_set():
            try:
                text = (await client.get("/metrics")).text
                row = {"t": time.perf_counter()}
                for c in range(cores):
                    lab = {"core": str(c)}
                    row[f"running{c}"] = metric(text, "ttsserve_num_requests_running", lab, missing=0.0)
                    row[f"waiting{c}"] = metric(text, "ttsserve_num_requests_waiting", lab, missing=0.0)
                samples.append(row)
            except httpx.HTTPError:
                pass
            await asyncio.sleep(every_s)
    return samples


async def _measured(url: str, cores: int, concurrency: int, duration: float, long_every: int = 0):
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(url, cores, stop))
    t0 = time.perf_counter()
    recs = await _load(url, concurrency, duration, long_every)
    wall = time.perf_counter() - t0
    stop.set()
    return recs, await sampler, wall


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _summary(recs: list[dict], wall: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    ttfa = [r["ttfa"] for r in ok if r["ttfa"] is not None]
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "audio_s_per_s": sum(r["audio_s"] for r in ok) / wall,
        "ttfa_p50_s": _q(ttfa, 0.5),
        "ttfa_p99_s": _q(ttfa, 0.99),
    }


def _idle_while_waiting(samples: list[dict], cores: int) -> int:
    """Samples where some core runs and queues nothing while another core has requests waiting."""
    bad = 0
    for s in samples:
        idle = [c for c in range(cores) if s[f"running{c}"] == 0 and s[f"waiting{c}"] == 0]
        waiting = [c for c in range(cores) if s[f"waiting{c}"] > 0]
        bad += bool(idle and waiting)
    return bad


def run(args) -> dict:
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"concurrency": args.concurrency, "duration_s": args.duration, "short_frames": SHORT}
    for cores in (1, 2):
        srv = Server(cores, out_dir / f"dp-cpu-server-{cores}.log")
        try:
            srv.wait()
            asyncio.run(_load(srv.url, args.concurrency, 5))  # warm-up
            recs, samples, wall = asyncio.run(_measured(srv.url, cores, args.concurrency, args.duration))
            res[f"uniform_{cores}_cores"] = _summary(recs, wall)
            if cores == 2:
                res["uniform_2_cores"]["idle_while_waiting_samples"] = _idle_while_waiting(samples, 2)
                # weak scaling: each core gets the streams one core had
                recs, _, wall = asyncio.run(_measured(srv.url, 2, 2 * args.concurrency, args.duration))
                res["uniform_2_cores_double_concurrency"] = _summary(recs, wall)
                recs, samples, wall = asyncio.run(_measured(srv.url, 2, args.concurrency, args.duration, 4))
                res["mixed_2_cores"] = _summary(recs, wall) | {
                    "samples": len(samples),
                    "idle_while_waiting_samples": _idle_while_waiting(samples, 2),
                    "long_frames": LONG,
                }
                res["kill"] = _kill(srv, args)
        finally:
            srv.stop()
    u1, u2, mixed = res["uniform_1_cores"], res["uniform_2_cores"], res["mixed_2_cores"]
    res["scaling_2_over_1"] = u2["audio_s_per_s"] / u1["audio_s_per_s"]
    res["weak_scaling_2_over_1"] = res["uniform_2_cores_double_concurrency"]["audio_s_per_s"] / u1["audio_s_per_s"]
    res["mixed_ttfa_p99_over_uniform"] = mixed["ttfa_p99_s"] / u2["ttfa_p99_s"]
    return res


def _kill(srv: Server, args) -> dict:
    """Load for 20 s; kill -9 core 1 after 5 s; count failures and core 0's service meanwhile."""

    async def go():
        load = asyncio.create_task(_load(srv.url, args.concurrency, 20))
        await asyncio.sleep(5)
        victim = srv.ready_cores()[1]["pid"]
        killed_at = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        back = None
        while back is None and time.perf_counter() - killed_at < 60:
            cores = srv.ready_cores()
            if len(cores) == 2 and cores[1]["ready"] and cores[1]["pid"] != victim:
                back = time.perf_counter() - killed_at
            await asyncio.sleep(0.1)
        return await load, killed_at, back

    recs, killed_at, back = asyncio.run(go())
    failed = [r for r in recs if not r["ok"]]
    after = [r for r in recs if r["t"] > killed_at + 0.5]  # sent once the router knew core 1 was gone
    return {
        "requests": len(recs),
        "failed": len(failed),
        "failed_started_before_kill": sum(r["t"] <= killed_at for r in failed),
        "failed_reasons": sorted({str(r["why"]) for r in failed}),
        "sent_after_kill": len(after),
        "errors_sent_after_kill": sum(not r["ok"] for r in after),
        "core1_back_in_rotation_s": back,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
