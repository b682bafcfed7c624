"""Benchmark result records and their summary figures (named units, one definition each).

Units: audio seconds at 24 kHz; one code frame = 512 samples = 512/24000 s (FRAME_SECONDS).
- frames_per_s: generated code frames (all requests) / wall seconds of the run.
- audio_seconds_per_s: seconds of returned audio (sum over requests) / wall seconds, the aggregate speed-up
  over real time (1.0 = exactly real time for one listener). Equals frames_per_s * FRAME_SECONDS up to the
  decoder's edge (a one-shot decode of n frames gives 512 n - 256 samples) and the 20-ms crossfade per
  segment seam.
- latency_s: submission to the last audio of a request; ttfa_s: submission to its first non-empty audio.
- rtf (per request): latency_s / its audio seconds (< 1 is faster than real time).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from ttsserve.constants import SAMPLE_RATE, SAMPLES_PER_FRAME

FRAME_SECONDS = SAMPLES_PER_FRAME / SAMPLE_RATE


@dataclass
class RequestRecord:
    """One request of a run. status: "ok" or an error label (HTTP status, "timeout", "error")."""

    request_id: str
    text_id: str = ""
    num_frames: int = 0  # code frames generated (0 when unknown, e.g. over HTTP)
    num_samples: int = 0  # audio samples returned at 24 kHz
    latency_s: float = math.nan
    ttfa_s: float | None = None
    finish_reason: str | None = None
    status: str = "ok"
    num_segments: int = 1
    underruns: int = 0  # serve, streaming only: times playback ran dry
    stall_s: float = 0.0  # serve, streaming only: total time playback waited for audio
    sent_at: float | None = None  # serve: wall-clock time of the send (epoch s), to line up with server logs

    @property
    def audio_s(self) -> float:
        return self.num_samples / SAMPLE_RATE


@dataclass
class RunResult:
    """One load point (a batch size, a concurrency or a QPS) of one backend."""

    backend: str  # "ttsserve" | "hf" | "server"
    mode: str  # "offline" | "serve"
    load_kind: str  # "batch_size" | "concurrency" | "qps"
    load: float
    wall_s: float
    requests: list[RequestRecord]
    peak_memory_bytes: int | None = None
    memory_kind: str | None = None  # "cuda_max_allocated" | "rss_peak_sampled" | "server_metrics"
    kv_cache_usage_peak: float | None = None  # fraction of the paged pool (ttsserve only)
    kv_cache_bytes_peak: int | None = None  # paged pool blocks in use, or the dense cache's size (hf)
    preemptions: int = 0
    steps: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """Every figure of the run (the JSON report's per-point record, minus the request list)."""
        ok = [r for r in self.requests if r.status == "ok"]
        frames = sum(r.num_frames for r in ok)
        audio_s = sum(r.audio_s for r in ok)
        lat = [r.latency_s for r in ok]
        ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
        rtf = [r.latency_s / r.audio_s for r in ok if r.audio_s > 0]
        errors: dict[str, int] = {}
        for r in self.requests:
            if r.status != "ok":
                errors[r.status] = errors.get(r.status, 0) + 1
        wall = max(self.wall_s, 1e-9)
        out = {
            "backend": self.backend,
            "mode": self.mode,
            "load_kind": self.load_kind,
            "load": self.load,
            "num_requests": len(self.requests),
            "num_ok": len(ok),
            "errors": errors,
            "wall_s": self.wall_s,
            "total_frames": frames,
            "audio_seconds": audio_s,
            "frames_per_s": frames / wall,
            "audio_seconds_per_s": audio_s / wall,
            "requests_per_s": len(ok) / wall,
            "latency_s": percentiles(lat),
            "ttfa_s": percentiles(ttfa),
            "rtf": percentiles(rtf),
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
            "kv_cache_usage_peak": self.kv_cache_usage_peak,
            "kv_cache_bytes_peak": self.kv_cache_bytes_peak,
            "preemptions": self.preemptions,
            "steps": self.steps,
        }
        if self.mode == "serve":  # frames are not visible over HTTP: only audio is counted
            out["total_frames"] = out["frames_per_s"] = None
            streamed = [r for r in ok if r.ttfa_s is not None]
            out["underrun_streams"] = sum(1 for r in streamed if r.underruns)
            out["underruns_total"] = sum(r.underruns for r in streamed)
            out["stall_s_total"] = sum(r.stall_s for r in streamed)
            warmup = self.extra.get("warmup_s")
            if warmup and streamed:  # a closed loop starts every stream at once, and their ends the next wave
                t0 = min(r.sent_at for r in self.requests)
                after = [r.ttfa_s for r in streamed if r.sent_at - t0 >= warmup]
                out["ttfa_s_after_warmup"] = percentiles(after)
                out["num_after_warmup"] = len(after)
        out.update(self.extra)
        return out

    def to_json(self) -> dict:
        """{"summary": figures, "run": the raw fields, "requests": every record}; from_json inverts it."""
        run = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        return {"summary": self.summary(), "run": run, "requests": [asdict(r) for r in self.requests]}

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        """Rebuild a run from its to_json() form (null latencies, written for strict JSON, become NaN)."""
        reqs = [
            RequestRecord(**(r | {"latency_s": math.nan if r["latency_s"] is None else r["latency_s"]}))
            for r in d["requests"]
        ]
        run = d.get("run")
        if run is None:  # reports written before "run" existed: the same fields sit in the summary
            names = [f.name for f in fields(cls) if f.name not in ("requests", "extra")]
            run = {k: d["summary"][k] for k in names if k in d["summary"]}
        return cls(requests=reqs, **run)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """{"p50": .., "p90": .., "p99": .., "mean": .., "max": ..} by linear interpolation over the finite
    values; None when there are none."""
    keys = [f"p{q}" for q in qs] + ["mean", "max"]
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return dict.fromkeys(keys)
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in qs}
    out.update(mean=float(arr.mean()), max=float(arr.max()))
    return out
