"""A fake EngineClient (engine/protocol.py), for server tests that must control timing/failures.

Audio: a sine per request whose frequency depends on (voice, seed, text) and whose length is 4 frames
per character (capped by max_new_tokens), streamed in chunks of `frames_per_chunk` frames with a real
asyncio sleep between chunks. KV "blocks" (ceil(frames / 16)) are held while a request runs and freed when
it finishes or its consumer goes away, so tests can check that a disconnect frees them.

Test hooks inside the text: "[[fail]]" fails after the first chunk, "[[failfirst]]" fails before any audio,
"[[eos]]" finishes normally ("stop") at once with no audio (EOS sampled at the first step).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator

import numpy as np

# The real contract types, so the fake cannot drift from what the engine yields.
from ttsserve.engine.errors import EngineOverloadedError, InvalidRequestError
from ttsserve.engine.profiler import CoreProfiler, profiler_dir
from ttsserve.engine.synthesis import AudioOutput, SegmentSpan
from ttsserve.params import SynthesisRequest
from ttsserve.text.speaker import decode_speaker

SAMPLES_PER_FRAME = 512  # 24000 / 46.875
HIDDEN = 768
BLOCK = 16


class FakeEngine:
    sample_rate = 24000
    model_name = "chattts"

    def __init__(
        self,
        *,
        frames_per_chunk: int = 8,
        chunk_delay_s: float = 0.002,
        num_blocks: int = 4096,
        max_queue_len: int = 1024,
    ) -> None:
        self.frames_per_chunk = frames_per_chunk
        self.chunk_delay_s = chunk_delay_s
        self.num_blocks = num_blocks
        self.max_queue_len = max_queue_len
        self.running: dict[str, int] = {}  # request_id -> blocks held
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: list[SynthesisRequest] = []
        self.references: list[tuple[int, int]] = []  # (num_samples, rate) given to encode_reference_audio
        self._started = False
        self._accepting = True
        self._aborts: set[str] = set()  # ids abort() ended, seen by their generator at its next chunk
        self.dead = False
        self.dead_reason: str | None = None
        self.drained_cleanly: bool | None = None
        self.profiler = CoreProfiler(profiler_dir())

    async def start(self) -> None:
        self._started = True

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while self.running and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.drained_cleanly = not self.running
        self._started = False

    @property
    def ready(self) -> bool:
        return self._started and self._accepting

    def stats(self) -> dict:
        used = sum(self.running.values())
        return {
            "num_running": len(self.running),
            "num_waiting": 0,
            "num_swapped": 0,
            "kv_cache_usage": used / self.num_blocks,
            "num_preemptions_total": 0,
            "num_swaps_total": 0,
            "step_time_ms_ema": 1.0,
            "used_blocks": used,
            "num_streams": len(self.running),
        }

    def memory_report(self) -> str:
        return f"KV cache: {self.num_blocks} blocks x {BLOCK} = {self.num_blocks * BLOCK} frames (fake)"

    def cores(self) -> list[dict]:
        return [{"core": 0, "ready": self.ready, "reason": self.dead_reason, "pid": None}]

    async def start_profile(self) -> None:
        self.profiler.start()

    async def stop_profile(self) -> list[str]:
        return [self.profiler.stop()]

    def random_speaker(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float16)

    def parse_speaker(self, s: str) -> np.ndarray:
        return decode_speaker(s, HIDDEN)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        self.references.append((int(wav.size), int(sample_rate)))
        p = max(1, round(wav.size / sample_rate * 46.875))
        return (np.arange(4 * p, dtype=np.int32).reshape(4, p) * 7) % 626

    async def generate(self, req: SynthesisRequest) -> AsyncIterator[AudioOutput]:
        if not self._accepting or not self._started:
            raise EngineOverloadedError("not accepting requests")
        if len(self.running) >= self.max_queue_len:
            raise EngineOverloadedError("queue full")
        if not any(c.isalnum() for c in re.sub(r"\[\w+_\d+\]", "", req.text)):  # control tags are not speech
            raise InvalidRequestError("text normalizes to nothing", "text")
        self.requests.append(req)
        rid = req.request_id or f"fake-{len(self.requests)}"
        cap = req.code_params.max_new_tokens
        want = 4 * len(req.text.replace("[[fail]]", "x"))
        total = min(want, cap)
        freq = self._frequency(req)
        self.running[rid] = -(-total // BLOCK)
        done = 0
        finished = False
        try:
            if "[[failfirst]]" in req.text:
                finished = True
                yield AudioOutput(rid, np.zeros(0, np.float32), True, 0, "error", error="injected failure")
                return
            if "[[eos]]" in req.text:
                finished = True
                yield AudioOutput(rid, np.zeros(0, np.float32), True, 0, "stop")
                return
            while done < total:
                await asyncio.sleep(self.chunk_delay_s)
                if rid in self._aborts:
                    self._aborts.discard(rid)  # recorded in self.aborted
                    yield AudioOutput(rid, np.zeros(0, np.float32), True, done, "abort")
                    return
                n = min(self.frames_per_chunk, total - done)
                t = np.arange(done * SAMPLES_PER_FRAME, (done + n) * SAMPLES_PER_FRAME) / self.sample_rate
                samples = (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
                done += n
                if "[[fail]]" in req.text and done > n:
                    finished = True
                    yield AudioOutput(rid, np.zeros(0, np.float32), True, done, "error", error="injected failure")
                    return
                last = done >= total
                reason = ("length" if want > cap else "stop") if last else None
                finished = last
                out = AudioOutput(rid, samples, last, done, reason, [0] if last and want > cap else [])
                if last:  # the whole text is one segment
                    out.segments = [SegmentSpan(0, req.text.strip(), 0, total * SAMPLES_PER_FRAME)]
                yield out
        finally:
            self.running.pop(rid, None)
            (self.finished if finished else self.aborted).append(rid)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self._aborts.add(request_id)

    @staticmethod
    def _frequency(req: SynthesisRequest) -> float:
        h = hashlib.sha1(f"{req.voice.key}|{req.code_params.seed}|{req.text}|{req.code_prompt}".encode())
        return 150.0 + int.from_bytes(h.digest()[:4], "little") % 600
