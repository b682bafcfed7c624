"""The engine's torch.profiler on demand (vLLM's `/start_profile` and `/stop_profile`): off unless
$TTSSERVE_TORCH_PROFILER_DIR names a directory, where each stop writes one gzipped Chrome trace per engine
core (open it in https://ui.perfetto.dev or chrome://tracing). The trace holds the host's torch ops and CUDA
runtime calls (a wait for the device shows as cudaEventSynchronize) and, on CUDA, every kernel, copy and graph
launch with its device time: what a py-spy profile of the step loop cannot say, such as which kernel held a
slow step. The profiler slows the host while it runs, and stopping it holds the step loop while it sorts what it
recorded (1-3 s after 2-4 s profiled on a loaded 2-core CPU); the trace is then written on a thread of its own,
as PATH.part.json, then PATH.part.gz, until it is complete (8-15 s there, 12 MB): profile seconds, not minutes.

Owned by the EngineCore (one thread); the clients forward start / stop to every core they hold.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from ttsserve.engine.errors import InvalidRequestError

PROFILER_DIR_ENV = "TTSSERVE_TORCH_PROFILER_DIR"

logger = logging.getLogger("ttsserve.engine")


def profiler_dir() -> str | None:
    """$TTSSERVE_TORCH_PROFILER_DIR, or None when profiling is off."""
    return os.environ.get(PROFILER_DIR_ENV) or None


class CoreProfiler:
    """start() / stop() -> the trace's path, for the process it runs in. Misuse (off, twice started, stopped
    while not running) raises InvalidRequestError: the caller's mistake, a 400 at the HTTP edge."""

    def __init__(self, out_dir: str | None) -> None:
        self.out_dir = out_dir
        self._prof = None
        self._started = 0.0

    def start(self) -> None:
        if self.out_dir is None:
            raise InvalidRequestError(f"profiling is off: start the server with ${PROFILER_DIR_ENV} set")
        if self._prof is not None:
            raise InvalidRequestError("the profiler is already running: stop it first")
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        prof = torch.profiler.profile(activities=activities)
        prof.start()
        self._prof, self._started = prof, time.monotonic()
        logger.info("torch profiler started (traces to %s)", self.out_dir)

    def stop(self) -> str:
        """Stop -> the trace's path (out_dir/ttsserve-core-PID-TIME.json.gz), which appears once written (a
        thread writes PATH.part.gz, then renames it). Call from the thread that steps the engine: torch's profiler
        stopped from another thread while that one runs ops crashes the process."""
        if self._prof is None:
            raise InvalidRequestError("the profiler is not running: start it first")
        prof, self._prof = self._prof, None
        prof.stop()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6}"
        path = str(Path(self.out_dir) / f"ttsserve-core-{os.getpid()}-{stamp}.json.gz")
        logger.info("torch profiler stopped after %.1f s; writing %s", time.monotonic() - self._started, path)
        threading.Thread(target=_write, args=(prof, path), name="ttsserve-trace-writer", daemon=True).start()
        return path


def _write(prof, path: str) -> None:
    """The trace as plain JSON (torch's C++ writer), then gzipped in 1-MiB blocks into PATH.part.gz and renamed.
    torch's own gzip path copies the JSON line by line in Python, which starves behind a busy step loop's GIL
    (a 4-s trace of a loaded H100 was still unwritten after the bench ended); zlib releases the GIL for a block."""
    t0 = time.monotonic()
    part = path + ".part"
    try:
        prof.export_chrome_trace(part + ".json")
        with open(part + ".json", "rb") as src, gzip.open(part + ".gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.remove(part + ".json")
        os.replace(part + ".gz", path)
    except Exception:
        logger.exception("writing the profiler trace %s failed", path)
        return
    logger.info("profiler trace written in %.1f s: %s", time.monotonic() - t0, path)
