"""Cold start: seconds from `ttsserve serve` process start to `/ready` 200, with the phases read from its log.

    python -m ttsserve.bench.coldstart --runs 3 -- --load-format dummy --dummy-size tiny --device cpu
    python -m ttsserve.bench.coldstart --cache-dummy real -- --device cpu --swap-space 0

`--cache-dummy SIZE` writes the random checkpoint once (safetensors, under $TTSSERVE_CACHE or
~/.cache/ttsserve) and serves it with `--model DIR --load-format safetensors`: later starts memory-map the file
instead of drawing ~250 M random numbers. Every run is a fresh process (no warm page cache guarantees beyond
what the OS keeps); the report gives each run and the median, in seconds.

`--until-warm` keeps each server up after /ready until its `ttsserve_engine_warm` gauge is 1 (on a GPU: the
CUDA graphs deferred past /ready are captured, engine/deferred_capture.py) and reports that time as warm_s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from ttsserve.model.dummy_cache import cached_dummy_checkpoint

# Log line -> phase name: the first line matching marks when the phase ended (seconds since process start).
PHASES = [
    ("imports", re.compile(r"loading model")),
    ("model_loaded", re.compile(r"loaded .* of weights")),
    # GPU only, inside the engine build:
    ("memory_profiled", re.compile(r"memory: .* for the KV cache")),
    ("runner_set_up", re.compile(r"runner set-up: ")),
    ("graphs_captured", re.compile(r"captured \d+ decode CUDA graphs?")),
    ("vocoder_graphs_captured", re.compile(r"captured \d+ vocoder CUDA graphs?")),
    ("warmed_up", re.compile(r"warmed up in ")),
    ("engine_built", re.compile(r"KV cache: ")),
    ("app_started", re.compile(r"Application startup complete|ttsserve ready")),
    ("deferred_graphs_captured", re.compile(r"captured \d+ deferred CUDA graph buckets")),  # after /ready
]
_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class ColdStart:
    """One start. total_s: process start -> first /ready 200. listen_s: -> the port accepted a connection.
    phases: phase name -> seconds since process start, for the PHASES log lines that were seen. warm_s:
    -> /metrics first showed every engine warm (measured with until_warm only)."""

    total_s: float
    listen_s: float | None
    phases: dict[str, float] = field(default_factory=dict)
    warm_s: float | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def parse_phases(log: str, t0: float) -> dict[str, float]:
    """Seconds since `t0` (a time.time()) at which each PHASES line first appears in `log`."""
    out: dict[str, float] = {}
    for line in log.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, pat in PHASES:
            if name not in out and pat.search(line):
                out[name] = round(t - t0, 3)
    return out


def _warm(port: int) -> bool:
    """/metrics shows ttsserve_engine_warm 1 for every engine core (and at least one)."""
    from ttsserve.bench.server_metrics import parse_prometheus

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            sample = parse_prometheus(r.read().decode())
    except (urllib.error.URLError, OSError):
        return False
    values = [v for k, v in sample.items() if k.split("{")[0] == "ttsserve_engine_warm"]
    return bool(values) and min(values) == 1.0


def measure_cold_start(
    serve_args: list[str],
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    poll_s: float = 0.05,
    until_warm: bool = False,
    log_path: str | None = None,
) -> ColdStart:
    """Start `python -m ttsserve.entrypoints.serve <serve_args> --port P`, wait for /ready 200 (until_warm:
    and then for every engine warm), stop it. RuntimeError (with the log tail) if it exits or is not ready
    (warm) within `timeout_s`. log_path: where to keep the server's log (its timestamps place every start-up
    line, not only the PHASES ones)."""
    port = free_port()
    cmd = [sys.executable, "-m", "ttsserve.entrypoints.serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.time()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        listen_s = total = warm_s = None
        try:
            while True:
                elapsed = time.perf_counter() - start
                if proc.poll() is not None or elapsed > timeout_s:
                    log.seek(0)
                    raise RuntimeError(
                        f"server {'exited' if proc.returncode is not None else 'not ready'} "
                        f"after {elapsed:.1f} s:\n{log.read()[-3000:]}"
                    )
                if listen_s is None and _listening(port):
                    listen_s = time.perf_counter() - start
                if total is None and listen_s is not None and _ready(port):
                    total = time.perf_counter() - start
                if total is not None and (not until_warm or _warm(port)):
                    warm_s = time.perf_counter() - start if until_warm else None
                    break
                time.sleep(poll_s)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read()
        if log_path:
            Path(log_path).write_text(text)
        warm = None if warm_s is None else round(warm_s, 3)
        return ColdStart(round(total, 3), round(listen_s, 3), parse_phases(text, t0), warm)


def import_floor_s() -> float:
    """Seconds for a fresh interpreter to import torch: the floor no server change can go below."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ttsserve.bench.coldstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--cache-dummy",
        choices=["tiny", "real"],
        default=None,
        help="serve a cached safetensors copy of the dummy checkpoint of this size",
    )
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--until-warm",
        action="store_true",
        help="after /ready, wait until /metrics shows every engine warm (deferred CUDA graphs captured)",
    )
    ap.add_argument("--log-dir", default=None, help="keep each run's server log here as run<i>.log")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `ttsserve serve` flags")
    a = ap.parse_args(argv)
    serve_args = a.serve_args[1:] if a.serve_args[:1] == ["--"] else a.serve_args
    if "--voices-db" not in serve_args:
        serve_args += ["--voices-db", ":memory:"]
    if a.cache_dummy:
        t = time.perf_counter()
        path = cached_dummy_checkpoint(a.cache_dummy)
        print(f"cached dummy checkpoint: {path} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
        serve_args += ["--model", str(path), "--load-format", "safetensors"]
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    runs = [
        measure_cold_start(
            serve_args, a.timeout, until_warm=a.until_warm, log_path=a.log_dir and f"{a.log_dir}/run{i}.log"
        )
        for i in range(a.runs)
    ]
    floor = import_floor_s()
    for i, r in enumerate(runs):
        warm = "" if r.warm_s is None else f", warm {r.warm_s:.2f} s"
        print(f"run {i}: ready {r.total_s:.2f} s{warm}, listening {r.listen_s:.2f} s, phases {r.phases}")
    med = statistics.median(r.total_s for r in runs)
    best = min(r.total_s for r in runs)  # on a shared machine the minimum is the least disturbed run
    print(
        f"{a.label or ' '.join(serve_args)}: cold start to /ready: median {med:.2f} s, min {best:.2f} s "
        f"(import torch alone: {floor:.2f} s)"
    )
    print(
        json.dumps(
            {
                "label": a.label,
                "serve_args": serve_args,
                "median_s": med,
                "min_s": best,
                "import_torch_s": floor,
                "runs": [asdict(r) for r in runs],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
