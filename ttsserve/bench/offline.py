"""`ttsserve bench offline`: drive a backend directly (no HTTP) with seeded batches of corpus texts.

For each batch size B, `rounds` batches of B requests are submitted all at once and run to completion; every
backend sees the same texts and the same per-request seeds. Fixed lengths (min_new_tokens == max_new_tokens =
frames) make random-weight runs comparable: EOS cannot end a request early.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ttsserve.bench.corpus import LANGS, LENGTHS, Sentence, select_texts
from ttsserve.bench.results import RequestRecord, RunResult
from ttsserve.bench.sysinfo import PeakMemory
from ttsserve.config import EngineConfig
from ttsserve.engine.step_stats import gc_pauses
from ttsserve.params import SamplingParams, SynthesisRequest

logger = logging.getLogger(__name__)


@dataclass
class OfflineSpec:
    """What to run. lengths: "fixed" (every segment generates exactly `frames` frames) or "natural" (until
    EOS, capped at `frames`). split: let the front end split long texts into segments (off: one sequence per
    request, so the batch size is the GPT batch size). warmup_frames: before each batch size, an untimed
    batch of that size generating this many frames, so that first-use compilation (torch.compile, Triton)
    of that batch's shapes is not timed; audio chunks grow to 64 frames, so warm with at least 8 + 16 + 32
    + 64 frames to cover every chunk shape (0: no warm-up)."""

    batch_sizes: Sequence[int] = (1, 8, 32)
    frames: int = 128
    lengths: str = "fixed"
    rounds: int = 1
    seed: int = 0
    langs: Sequence[str] = LANGS
    text_lengths: Sequence[str] = LENGTHS
    split: bool = False
    warmup_frames: int = 8
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive, got {list(self.batch_sizes)}")
        if self.frames < 1:
            raise ValueError(f"frames must be >= 1, got {self.frames}")
        if self.lengths not in ("fixed", "natural"):
            raise ValueError(f"lengths must be fixed|natural, got {self.lengths!r}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")

    def params(self, index: int) -> SamplingParams:
        """Sampling parameters of request `index` of a batch: the code defaults with a per-request seed."""
        low = self.frames if self.lengths == "fixed" else 0
        return SamplingParams(
            min_new_tokens=low, max_new_tokens=self.frames, seed=self.seed * 1_000_003 + index, greedy=self.greedy
        )

    def batches(self, batch_size: int) -> list[list[Sentence]]:
        texts = select_texts(
            batch_size * self.rounds,
            seed=self.seed + batch_size,
            langs=tuple(self.langs),
            lengths=tuple(self.text_lengths),
        )
        return [texts[r * batch_size : (r + 1) * batch_size] for r in range(self.rounds)]


@dataclass
class BatchRun:
    """What a backend measured for one batch (merged over rounds into one RunResult)."""

    wall_s: float
    records: list[RequestRecord]
    peak_memory_bytes: int | None = None
    memory_kind: str | None = None
    kv_cache_usage_peak: float | None = None
    kv_cache_bytes_peak: int | None = None
    preemptions: int = 0
    steps: int = 0
    extra: dict = field(default_factory=dict)


class TTSServeBackend:
    """The ttsserve Engine, stepped in this thread; audio is timed as the engine releases it."""

    name = "ttsserve"

    def __init__(self, cfg: EngineConfig, engine=None) -> None:
        if engine is None:
            from ttsserve.engine.engine import Engine

            engine = Engine(cfg)
        engine.wait_warm()  # time the steady state: the CPU attention compile runs in the background
        self.engine = engine
        self.device = str(engine.model.device)
        self._ids = itertools.count()

    def run_batch(
        self, sentences: Sequence[Sentence], params: Sequence[SamplingParams], split: bool, bar=None
    ) -> BatchRun:
        eng = self.engine
        mem = PeakMemory(self.device)
        mem.start()
        c0 = (eng.counters.preemptions, eng.counters.steps, eng.counters.frames)
        records: dict[str, RequestRecord] = {}
        t0 = time.perf_counter()
        for s, p in zip(sentences, params):
            rid = eng.add_synthesis(
                SynthesisRequest(s.text, code_params=p, split=split, request_id=f"bench-{next(self._ids)}")
            )
            records[rid] = RequestRecord(rid, s.id, num_segments=len(eng.syntheses[rid].segments))
        admit_s, phases0 = time.perf_counter() - t0, _host_phases(eng)
        pending, usage_peak, frames_seen = set(records), 0.0, c0[2]
        while pending:
            if not eng.has_unfinished():
                raise RuntimeError(f"engine went idle with {len(pending)} bench requests unfinished")
            outputs = eng.step()
            now = time.perf_counter() - t0
            usage_peak = max(usage_peak, eng.kv_manager.usage)
            mem.sample()
            for out in outputs:
                rec = records.get(out.request_id)
                if rec is None:
                    continue
                if out.samples.size:
                    rec.num_samples += int(out.samples.size)
                    rec.ttfa_s = now if rec.ttfa_s is None else rec.ttfa_s
                if out.finished:
                    rec.latency_s, rec.num_frames, rec.finish_reason = now, out.num_frames, out.finish_reason
                    rec.status = "error" if out.finish_reason == "error" else "ok"
                    pending.discard(out.request_id)
            if bar is not None:
                bar.update(eng.counters.frames - frames_seen)
                frames_seen = eng.counters.frames
        wall = time.perf_counter() - t0
        spec = eng.kv_spec
        phases = {k: v - phases0[k] for k, v in _host_phases(eng).items()}
        return BatchRun(
            wall,
            list(records.values()),
            mem.peak(),
            mem.kind,
            usage_peak,
            int(usage_peak * spec.num_blocks * spec.block_size * spec.bytes_per_token),
            eng.counters.preemptions - c0[0],
            eng.counters.steps - c0[1],
            extra={"admit_s": admit_s, "host_ms": phases},
        )

    def describe(self) -> dict:
        return {
            "backend": self.name,
            "device": self.device,
            "dtype": str(self.engine.model.dtype),
            "kv_cache": self.engine.memory_report(),
            "model_source": self.engine.model.source,
        }


def _host_phases(eng) -> dict[str, float]:
    """The engine's cumulative host ms by phase (Engine.timings), the runner's wait for the device split out of
    its runner_ms (RunnerTimings.forward_ms) and the garbage collector's pauses (gc_ms, inside the phases): what
    a round spent where, without a profiler."""
    phases = dict(eng.timings.__dict__)
    phases["runner_wait_ms"] = eng.runner.timings.forward_ms  # part of runner_ms
    phases["gc_ms"] = gc_pauses().total_s() * 1e3  # the process's GC passes, inside whichever phases they stopped
    return phases


def _merge_extra(runs: list[BatchRun]) -> dict:
    """Rounds' extras -> one: admit_s per round, host_ms summed and then per step (a backend's other keys from
    its first round)."""
    extra = {"rounds": len(runs), **runs[0].extra}
    if "admit_s" in extra:
        steps = max(sum(r.steps for r in runs), 1)
        extra["admit_s"] = [r.extra["admit_s"] for r in runs]
        extra["host_ms"] = {k: sum(r.extra["host_ms"][k] for r in runs) / steps for k in runs[0].extra["host_ms"]}
    return extra


def merge_runs(backend: str, batch_size: int, runs: list[BatchRun]) -> RunResult:
    """Rounds of one batch size -> one RunResult (walls add up, request lists pool, peaks take the max)."""

    def peak(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    return RunResult(
        backend=backend,
        mode="offline",
        load_kind="batch_size",
        load=batch_size,
        wall_s=sum(r.wall_s for r in runs),
        requests=[rec for r in runs for rec in r.records],
        peak_memory_bytes=peak(r.peak_memory_bytes for r in runs),
        memory_kind=runs[0].memory_kind,
        kv_cache_usage_peak=peak(r.kv_cache_usage_peak for r in runs),
        kv_cache_bytes_peak=peak(r.kv_cache_bytes_peak for r in runs),
        preemptions=sum(r.preemptions for r in runs),
        steps=sum(r.steps for r in runs),
        extra=_merge_extra(runs),
    )


def _host_line(extra: dict) -> str:
    """'; admission 0.270 s a round; host ms a step: schedule 0.33, runner 15.19, ...' for the log line."""
    ms = extra["host_ms"]
    parts = ", ".join(f"{k.removesuffix('_ms')} {v:.2f}" for k, v in ms.items() if v >= 0.005)
    admit = sum(extra["admit_s"]) / len(extra["admit_s"])
    return f"; admission {admit:.3f} s a round; host ms a step: {parts}"


def run_offline(spec: OfflineSpec, backend, progress: bool = True) -> list[RunResult]:
    """Every batch size of `spec` on one backend (anything with run_batch(sentences, params, split, bar))."""
    from tqdm import tqdm

    results: list[RunResult] = []
    for b in spec.batch_sizes:
        if spec.warmup_frames:
            warm = SamplingParams(min_new_tokens=spec.warmup_frames, max_new_tokens=spec.warmup_frames, seed=0)
            backend.run_batch(select_texts(b, seed=spec.seed + 7919), [warm] * b, spec.split)
        runs = []
        for batch in spec.batches(b):
            params = [spec.params(i) for i in range(len(batch))]
            with tqdm(
                total=spec.frames * len(batch),
                unit="frame",
                disable=not progress,
                leave=False,
                desc=f"{backend.name} batch {b}",
            ) as bar:
                runs.append(backend.run_batch(batch, params, spec.split, bar))
        results.append(merge_runs(backend.name, b, runs))
        s, extra = results[-1].summary(), results[-1].extra
        logger.info(
            "%s batch %d: %.1f frames/s, %.2f audio-s/s, latency p50 %.2f s, ttfa p50 %s%s",
            backend.name,
            b,
            s["frames_per_s"],
            s["audio_seconds_per_s"],
            s["latency_s"]["p50"] or 0.0,
            s["ttfa_s"]["p50"],
            _host_line(extra) if "host_ms" in extra else "",
        )
    return results
