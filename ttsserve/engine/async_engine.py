"""AsyncEngine: the step loop in one background thread, an async stream of AudioOutput per request.

Requests and aborts cross into the engine thread through an inbox; outputs come back to the event loop with
`call_soon_threadsafe`. The loop survives any single bad request: input errors are raised to the caller
before anything is queued, and an internal failure during a step fails the requests of that step with an
error while the engine keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.constants import MODEL_NAME, SAMPLE_RATE, speaker_stats
from ttsserve.engine.engine import Engine
from ttsserve.engine.core.heap import FreezeWhenWarm
from ttsserve.engine.errors import EngineOverloadedError
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "AudioOutput", "EngineOverloadedError", "fail_all"]


class AsyncEngine:
    sample_rate = SAMPLE_RATE

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = MODEL_NAME
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._accepting = True
        self._last_step = 0.0
        self._stats: dict = engine.stats()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(Engine(cfg))

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ttsserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (up to the timeout), then stop the loop."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, req: SynthesisRequest) -> AsyncIterator[AudioOutput]:
        """Stream the audio of `req`. ValueError (bad input) is raised before the first output."""
        if not self._accepting or not self.ready:
            raise EngineOverloadedError("the engine is not accepting requests (starting or shutting down)")
        if len(self._streams) >= self.engine.cfg.max_queue_len:
            raise EngineOverloadedError(f"too many requests in flight ({len(self._streams)})")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        admitted: Future = Future()
        self._inbox.put(("add", req, (loop, q), admitted))
        self._wake.set()
        rid = await asyncio.wrap_future(admitted)  # raises ValueError from the front end
        finished = False
        try:
            while True:
                out: AudioOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away: free the request's blocks at the next step
                self._inbox.put(("abort", rid, None, None))
                self._wake.set()

    def stats(self) -> dict:
        return dict(self._stats, num_streams=len(self._streams))

    def memory_report(self) -> str:
        return self.engine.memory_report()

    # ---- voices ------------------------------------------------------------------------------------
    def random_speaker(self, seed: int) -> np.ndarray:
        from ttsserve.text.speaker import sample_random_speaker

        std, mean = speaker_stats(self.engine.model.spk_stat, self.engine.model.hidden_size)
        return sample_random_speaker(std, mean, seed)

    def parse_speaker(self, s: str) -> np.ndarray:
        from ttsserve.text.speaker import decode_speaker

        return decode_speaker(s, dim=self.engine.model.hidden_size)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording -> int32 [num_vq, P] audio-code prompt (DVAE encoder, MODEL.md §5.4)."""
        from ttsserve.engine.voice_encode import encode_reference

        return encode_reference(self.engine.model, wav, sample_rate)

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if self.engine.model.device.type == "cpu":
            from ttsserve.runner.cpu_threads import configure_cpu_threads

            configure_cpu_threads(self.engine.cfg.cpu_threads)  # the engine thread runs every torch op
        freeze = FreezeWhenWarm(self.engine, "server")
        while not self._stopping:
            freeze.check()
            self._drain_inbox()
            # Aborted requests are released by the scheduler's next step, so step while any remain.
            if not (self.engine.has_unfinished() or self.engine.scheduler.has_unfinished_requests()):
                self._stats = self.engine.stats()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step(emit=self._deliver_all)  # audio done early leaves in mid-step
            except Exception as e:  # one guarded place: fail this step's requests, keep serving
                logger.exception("engine step failed")
                outputs = self._fail_all(f"internal error: {type(e).__name__}: {e}")
            self._stats = self.engine.stats()
            self._last_step = time.monotonic()
            self._deliver_all(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(payload)
                self._streams.pop(payload, None)
                continue
            try:
                rid = self.engine.add_synthesis(payload)
            except Exception as e:  # ValueError for bad input; anything else is reported, not fatal
                fut.set_exception(e if isinstance(e, ValueError) else RuntimeError(str(e)))
                continue
            self._streams[rid] = stream
            fut.set_result(rid)

    def _deliver_all(self, outputs: list[AudioOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: AudioOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        loop, q = stream
        if out.finished:
            self._streams.pop(out.request_id, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the client's event loop is gone
            self.engine.abort(out.request_id)

    def _fail_all(self, message: str) -> list[AudioOutput]:
        return fail_all(self.engine, message)


def fail_all(engine: Engine, message: str) -> list[AudioOutput]:
    """Abort every synthesis of `engine` (after a failed step) -> one final error output each."""
    outputs = []
    for rid in list(engine.syntheses):
        engine.abort(rid)
        outputs.append(AudioOutput(rid, np.zeros(0, np.float32), True, finish_reason="error", error=message))
    return outputs
