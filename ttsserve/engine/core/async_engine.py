"""AsyncEngine: the in-process EngineClient. The EngineCore runs on one background thread; each request is
an async stream of AudioOutput.

Requests go through the InputProcessor on the caller's event loop (text work, request id), then cross into
the engine thread through an inbox; outputs come back with `call_soon_threadsafe`. The loop survives any
single bad request: input errors are raised to the caller before anything is queued, and a failing step
fails that step's requests while the engine keeps serving (EngineCore.step). An exception that escapes the
loop itself kills the engine for good: in-flight streams end with an error output, and every later call
raises EngineDeadError. A loop that has not turned for `stall_timeout_s` (it turns every 50 ms idle, once per
step busy) is stalled: `dead` says so while it lasts (/health and /ready answer 503, new requests get
EngineDeadError), and clears if the step ends after all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

import numpy as np

from ttsserve.config import EngineConfig
from ttsserve.engine.core.engine_core import EngineCore
from ttsserve.engine.core.heap import FreezeWhenWarm
from ttsserve.engine.core.liveness import Liveness, LivenessReport
from ttsserve.engine.engine import Engine
from ttsserve.engine.errors import EngineDeadError, EngineOverloadedError
from ttsserve.engine.input_processor import InputProcessor
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "AudioOutput", "EngineOverloadedError"]


def _final(rid: str, reason: str, error: str | None = None) -> AudioOutput:
    return AudioOutput(rid, np.zeros(0, np.float32), True, finish_reason=reason, error=error)


def _may_be_admitted(fut: Future) -> bool:
    """The engine thread took the add (running) or admitted it, though its consumer never saw the answer."""
    return fut.running() or (fut.done() and not fut.cancelled() and fut.exception() is None)


class AsyncEngine(LivenessReport):
    """An EngineClient (engine/protocol.py) running `engine` on a thread of this process."""

    def __init__(self, engine: Engine, stall_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.liveness = Liveness(stall_timeout_s, "the engine is stalled: its step loop has not turned")
        self.core = EngineCore(engine)
        self.model_name = self.core.model_name
        self.sample_rate = self.core.sample_rate
        self.processor = InputProcessor(engine.model.tokenizer)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # engine thread only: request id -> (the consumer's loop, its queue), for admitted requests
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # event loop only: request id -> (the id its outputs carry, its queue), for abort()
        self._live: dict[str, tuple[str, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats: dict = engine.stats()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> AsyncEngine:
        return cls(Engine(cfg))

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self.processor.warm_up()
            self.liveness.sign()
            self.liveness.watching = True
            if self.engine.model.device.type == "cpu":
                from ttsserve.runner.cpu_threads import release_openmp_pool

                release_openmp_pool()  # this thread built the engine; its idle team would stop the engine's spinning
            self._thread = threading.Thread(target=self._run, name="ttsserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (up to the timeout), then stop the loop."""
        self.core.accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._live and not self.dead and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return alive and self.core.accepting and not self._stopping and not self.dead

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, req: SynthesisRequest) -> AsyncIterator[AudioOutput]:
        """Stream the audio of `req` (the EngineClient contract)."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        if not self.ready:
            raise EngineOverloadedError("the engine is not accepting requests (starting or shutting down)")
        public = req.request_id
        req, segments = self.processor.process(req)
        rid = req.request_id
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        admitted: Future = Future()
        self._post(("add", (req, segments), (loop, q), admitted))
        if self.liveness.lost is not None:  # died between the check above and the post: nobody else will answer it
            self._fail_inbox(self.liveness.lost)
        ok = finished = False
        try:
            await asyncio.wrap_future(admitted)  # the EngineCore's typed error, if it refused
            ok = True
            self._live[rid] = (public or rid, q)
            while True:
                out: AudioOutput = await q.get()
                if public is not None:
                    out.request_id = public
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._live.pop(rid, None)
            if not finished and (ok or _may_be_admitted(admitted)):  # the consumer went away: free its blocks
                self._post(("abort", rid, None, None))

    async def abort(self, request_id: str) -> None:
        for rid, (out_id, q) in list(self._live.items()):
            if out_id == request_id:
                self._live.pop(rid)
                self._post(("abort", rid, None, None))
                q.put_nowait(_final(rid, "abort"))

    def stats(self) -> dict:
        return dict(self._stats, num_streams=len(self._live))

    def memory_report(self) -> str:
        return self.core.memory_report()

    def cores(self) -> list[dict]:
        return [{"core": 0, "ready": self.ready, "reason": self.dead_reason, "pid": os.getpid()}]

    async def start_profile(self) -> None:
        await self._on_engine_thread(self.core.start_profile)

    async def stop_profile(self) -> list[str]:
        return [await self._on_engine_thread(self.core.stop_profile)]

    async def _on_engine_thread(self, fn):
        """fn() on the engine thread, between steps -> its result (its exception raised here). For what must
        run where the torch ops run: the profiler, stopped on another thread than the one stepping, crashes."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        if not self.ready:
            raise EngineOverloadedError("the engine is not accepting requests (starting or shutting down)")
        done: Future = Future()
        self._post(("call", fn, None, done))
        return await asyncio.wrap_future(done)

    # ---- voices ------------------------------------------------------------------------------------
    def random_speaker(self, seed: int) -> np.ndarray:
        return self.core.random_speaker(seed)

    def parse_speaker(self, s: str) -> np.ndarray:
        return self.core.parse_speaker(s)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording -> int32 [num_vq, P] audio-code prompt (DVAE encoder, MODEL.md §5.4)."""
        return self.core.encode_reference_audio(wav, sample_rate)

    # ---- the engine thread -------------------------------------------------------------------------
    def _post(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine is dead: every consumer is told
            logger.exception("the engine thread died")
            self._die(f"the engine thread died: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        if self.engine.model.device.type == "cpu":
            from ttsserve.runner.cpu_threads import configure_cpu_threads

            configure_cpu_threads(self.engine.cfg.cpu_threads)  # the engine thread runs every torch op
        freeze = FreezeWhenWarm(self.engine, "server")
        core = self.core
        while not self._stopping:
            self.liveness.sign()
            freeze.check()
            self._drain_inbox()
            if not core.busy():
                if core.background_work(busy=False):  # a deferred graph capture; then the inbox again
                    self._stats = core.stats()
                    continue
                self._stats = core.stats()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            outputs = core.step(emit=self._deliver_all)  # audio done early leaves in mid-step
            self._stats = core.stats()
            self._deliver_all(outputs)
            if core.background_work(busy=True):
                self._stats = core.stats()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.core.abort(payload)
                self._streams.pop(payload, None)
                continue
            if kind == "call":  # _on_engine_thread
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(payload())
                    except Exception as e:  # noqa: BLE001 - the caller's to raise
                        fut.set_exception(e)
                continue
            if not fut.set_running_or_notify_cancel():  # the consumer left before its turn
                continue
            req, segments = payload
            try:
                rid = self.core.add(req, segments)
            except Exception as e:  # noqa: BLE001 - InvalidRequestError, EngineOverloadedError, RuntimeError
                fut.set_exception(e)
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
            self.core.abort(out.request_id)

    def _die(self, reason: str) -> None:
        self.liveness.lost = reason
        for rid in list(self._streams):
            self._deliver(_final(rid, "error", reason))
        self._fail_inbox(reason)

    def _fail_inbox(self, reason: str) -> None:
        while True:
            try:
                _, _, _, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError(reason))
