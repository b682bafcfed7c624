"""CoreClient: the EngineClient (engine/protocol.py) of an API-server process, served by an engine core over ZMQ.

One DEALER socket (identity `api-<index>`) to the core's ROUTER, used only from the event loop's thread;
a receive task routes the core's batched outputs to one asyncio.Queue per request. A socket monitor
watches the connection: when the core process dies, every in-flight request fails (EngineDeadError if it had
no output yet, else an error output ends it), pending utility calls fail, `ready` turns False and `dead`
True. Nothing waits on a dead core. `dead` means dead now: when the launcher has started a new core at the
same address the socket reconnects, the client says Hello again, and once the new core's CoreInfo arrives
the client serves again.

The core sends every API server a message at least every proc.HEARTBEAT_INTERVAL_S, idle or not; a core
not heard from for `stall_timeout_s` is stalled (a hung step, a SIGSTOP: the connection stays up), which
`dead` reports too, so /health and /ready say 503 and no new request waits behind it.

random_speaker / parse_speaker run here, from the speaker statistics the core sends in its CoreInfo: the
app calls them synchronously on the event loop, where a round trip would wait behind an engine step. They
give the same vectors as the core's utility calls of the same names. The core's tokenizer comes with the
CoreInfo too, so the InputProcessor tokenizes the code prompts of requests without a refine pass here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ttsserve.constants import MODEL_NAME, SAMPLE_RATE
from ttsserve.engine.core.liveness import Liveness, LivenessReport
from ttsserve.engine.core.messages import (
    Abort,
    AddRequest,
    ArrayMsg,
    CoreInfo,
    CoreOutputs,
    Hello,
    SegmentMsg,
    SynthesisMsg,
    UtilityCall,
    UtilityReply,
    core_decoder,
    encoder,
)
from ttsserve.engine.errors import (
    CoreUnreachableError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
)
from ttsserve.engine.input_processor import InputProcessor
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest

logger = logging.getLogger("ttsserve.core_client")

HANDSHAKE_TIMEOUT_S = 60.0
UTILITY_TIMEOUT_S = 300.0


@dataclass
class _Stream:
    queue: asyncio.Queue  # AudioOutput, in order
    admitted: asyncio.Future  # None once the core admitted the request; the core's error if it refused
    public_id: str | None  # the request_id the caller gave (outputs carry it back)


class CoreClient(LivenessReport):
    """The engine as seen from one API server. `index` must be unique among the core's API servers."""

    sample_rate = SAMPLE_RATE
    model_name = MODEL_NAME

    def __init__(
        self,
        address: str,
        index: int = 0,
        stall_timeout_s: float = 60.0,
        handshake_timeout_s: float | None = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.index = index
        self.handshake_timeout_s = handshake_timeout_s  # None: wait for the core as long as it loads
        # lost: why the connection to the core is down (until a new core says hello); a sign: any message heard
        self.liveness = Liveness(stall_timeout_s, "the engine core is stalled: not heard from")
        self._info: CoreInfo | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.processor = InputProcessor(None, index)  # the core's tokenizer joins it at the handshake
        self._stats: dict = {}
        # frames (engine/load.py estimates) of this server's requests not yet in a stats report of the core:
        # sent and not admitted yet, or admitted since the last report (rid -> [frames, admitted])
        self._unreported: dict[str, list] = {}
        self.unreported_frames = 0
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._hello: asyncio.Future | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect and handshake. RuntimeError if the core does not answer within handshake_timeout_s."""
        if self._sock is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        sock = self._sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"api-{self.index}".encode())
        sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core's queue is the bound
        sock.setsockopt(zmq.RCVHWM, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sock.connect(self.address)
        self._hello = self._loop.create_future()
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="core-client-recv"),
            asyncio.create_task(self._watch(monitor), name="core-client-watch"),
        ]
        self._post(Hello(self.index, os.getpid()))
        try:
            info: CoreInfo = await asyncio.wait_for(self._hello, self.handshake_timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"the engine core at {self.address} did not answer in {self.handshake_timeout_s:.0f} s"
            ) from None
        self.sample_rate, self.model_name = info.sample_rate, info.model_name
        if info.tokenizer_json is not None:
            from ttsserve.text.tokenizer import TextTokenizer

            self.processor.tokenizer = TextTokenizer.from_json(info.tokenizer_json)
        logger.debug("text path warmed up in %.2f s", self.processor.warm_up())
        self._stats = dict(info.stats)
        self._info = info
        self.liveness.sign()
        self.liveness.watching = True
        self._accepting = True

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let this server's in-flight requests finish (up to the timeout), abort the rest,
        close the connection. The core keeps running for the other API servers."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout_s
        while self._streams and not self.dead and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._streams and self.liveness.lost is None:
            self._post(Abort(list(self._streams)))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=500)  # the abort above still leaves
        self._sock = None

    @property
    def ready(self) -> bool:
        return self._info is not None and self._accepting and not self.dead

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, req: SynthesisRequest, frames: int = 0) -> AsyncIterator[AudioOutput]:
        """Stream the audio of `req` (the EngineClient contract); a core that dies mid-stream ends it with an
        error output. frames: its estimated work, counted in unreported_frames until the core's stats
        include it."""
        if self.dead:
            raise CoreUnreachableError(self.dead_reason)
        if not self.ready:
            raise EngineOverloadedError("the engine is not accepting requests (starting or shutting down)")
        rid = self.processor.engine_request_id(req.request_id)
        if rid in self._streams:  # this map's key; the core refuses duplicates among all API servers
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use", "request_id")
        segments = self.segment_msgs(req)
        msg = msgspec.structs.replace(SynthesisMsg.of(req), request_id=rid)
        stream = _Stream(asyncio.Queue(), self._loop.create_future(), req.request_id)
        self._streams[rid] = stream
        self._unreported[rid] = [frames, False]
        self.unreported_frames += frames
        admitted = finished = yielded = False
        try:
            self._post(AddRequest(rid, msgspec.Raw(encoder.encode(msg)), segments))
            await stream.admitted
            admitted = True
            while True:
                out: AudioOutput | EngineDeadError = await stream.queue.get()
                if isinstance(out, EngineDeadError):  # the core died: a 503 if nothing went out yet
                    if not yielded:
                        raise out
                    out = AudioOutput(
                        req.request_id or rid, np.zeros(0, np.float32), True, finish_reason="error", error=str(out)
                    )
                yielded = True
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            self._reported(rid)
            pending = not stream.admitted.done()  # the core may still admit it: abort it all the same
            if pending:
                stream.admitted.cancel()
            if (
                (admitted or pending) and not finished and self.liveness.lost is None
            ):  # the consumer went away: free its blocks
                self._post(Abort([rid]))

    def segment_msgs(self, req: SynthesisRequest) -> list[SegmentMsg]:
        """The InputProcessor's segments of `req` (tokenized with the core's tokenizer) as wire messages.
        InvalidRequestError (the caller's 400, without a round trip) for input the text path refuses."""
        return [SegmentMsg.of(s) for s in self.processor.segments(req)]

    async def abort(self, request_id: str) -> None:
        for rid, s in list(self._streams.items()):
            if (s.public_id or rid) == request_id:
                self._streams.pop(rid)
                if self.liveness.lost is None:
                    self._post(Abort([rid]))  # after its AddRequest: the core admits it, then aborts it
                if not s.admitted.done():
                    s.admitted.set_result(None)
                s.queue.put_nowait(AudioOutput(request_id, np.zeros(0, np.float32), True, finish_reason="abort"))

    @property
    def outstanding_frames(self) -> int:
        """The core's outstanding frames as it last reported them, plus this server's requests that report
        does not count yet: what data-parallel routing weighs."""
        reported = 0 if self.dead else self._stats.get("outstanding_frames", 0)
        return int(reported) + self.unreported_frames

    def stats(self) -> dict:
        """The core's engine stats (shared by all API servers; ~0.1 s old at most), plus num_streams: this
        server's requests in flight. Empty but for num_streams once the core is gone."""
        base = {} if self.dead else self._stats
        return dict(base, num_streams=len(self._streams))

    def memory_report(self) -> str:
        return self._info.memory_report if self._info is not None else "engine core not connected"

    def cores(self) -> list[dict]:
        return [self.core_state(0)]

    async def start_profile(self) -> None:
        await self.call("start_profile")

    async def stop_profile(self) -> list[str]:
        return [await self.call("stop_profile")]

    def core_state(self, index: int) -> dict:
        pid = None if self._info is None or self.dead else self._info.pid
        return {"core": index, "ready": self.ready, "reason": self.dead_reason, "pid": pid}

    # ---- voices ------------------------------------------------------------------------------------
    def random_speaker(self, seed: int) -> np.ndarray:
        from ttsserve.text.speaker import sample_random_speaker

        info = self._connected_info()
        return sample_random_speaker(info.spk_std.array(), info.spk_mean.array(), seed)

    def parse_speaker(self, s: str) -> np.ndarray:
        from ttsserve.text.speaker import decode_speaker

        return decode_speaker(s, dim=self._connected_info().hidden_size)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording -> int32 [num_vq, P] audio-code prompt, computed by the core. Blocking: call
        it from a worker thread (the app does, with asyncio.to_thread). ValueError for unusable audio."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the core client is not started")
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            raise RuntimeError("encode_reference_audio blocks; call it from a worker thread")
        coro = self.call("encode_reference_audio", ArrayMsg.of(np.asarray(wav, np.float32)), int(sample_rate))
        return asyncio.run_coroutine_threadsafe(coro, loop).result(UTILITY_TIMEOUT_S + 5)

    async def call(self, method: str, *args, timeout_s: float = UTILITY_TIMEOUT_S):
        """Run a utility method in the core (stats, memory_report, random_speaker, parse_speaker,
        encode_reference_audio). Arrays come back as numpy arrays; errors keep their kind and message."""
        if self._sock is None or self.dead:
            raise RuntimeError(self.dead_reason or "the core client is not started")
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = self._loop.create_future()
        self._post(UtilityCall(call_id, method, list(args)))
        try:
            reply: UtilityReply = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise reply.error.exception()
        return reply.result.array() if isinstance(reply.result, ArrayMsg) else reply.result

    # ---- the connection ----------------------------------------------------------------------------
    def _connected_info(self) -> CoreInfo:
        if self._info is None:
            raise RuntimeError("the core client is not started")
        return self._info

    def _post(self, msg) -> None:
        # No high-water mark: the send completes at once, so callers (finally blocks included) never await.
        if self._sock is not None and not self._sock.closed:
            self._sock.send(encoder.encode(msg))

    async def _receive_loop(self) -> None:
        while True:
            frame = await self._sock.recv()
            self.liveness.sign()
            try:
                msg = core_decoder.decode(frame)
            except msgspec.DecodeError as e:
                logger.error("dropped an undecodable message from the engine core: %s", e)
                continue
            if isinstance(msg, CoreOutputs):
                self._on_outputs(msg)
            elif isinstance(msg, UtilityReply):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, CoreInfo):
                self._on_hello(msg)

    def _reported(self, rid: str) -> None:
        entry = self._unreported.pop(rid, None)
        if entry is not None:
            self.unreported_frames -= entry[0]

    def _on_outputs(self, msg: CoreOutputs) -> None:
        for rid in msg.admitted:
            s = self._streams.get(rid)
            if s is not None and not s.admitted.done():
                s.admitted.set_result(None)
            if (entry := self._unreported.get(rid)) is not None:
                entry[1] = True
        if msg.stats is not None:  # built when this message was sent: it counts every request admitted so far
            self._stats = msg.stats
            for rid in [rid for rid, (_, admitted) in self._unreported.items() if admitted]:
                self._reported(rid)
        for rej in msg.rejected:
            s = self._streams.get(rej.request_id)
            if s is not None and not s.admitted.done():
                s.admitted.set_exception(rej.error.exception())
        for o in msg.outputs:
            s = self._streams.get(o.request_id)
            if s is not None:  # None: this server aborted it already
                s.queue.put_nowait(o.output(s.public_id))

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._core_gone("the engine core process is gone")
                elif event["event"] == zmq.EVENT_CONNECTED and self.liveness.lost is not None:
                    logger.info("an engine core is up at %s again: saying hello", self.address)
                    self._post(Hello(self.index, os.getpid()))  # its CoreInfo (_receive_loop) revives us
        finally:
            monitor.close(linger=0)

    def _on_hello(self, info: CoreInfo) -> None:
        if self._hello is not None and not self._hello.done():
            self._hello.set_result(info)
        elif self.liveness.lost is not None:  # a new core after a death
            self._info, self._stats, self.liveness.lost = info, dict(info.stats), None
            logger.info("reconnected to the engine core (pid %d)", info.pid)

    def _core_gone(self, reason: str) -> None:
        if self.liveness.lost is not None:
            return
        self.liveness.lost = reason
        logger.error("%s: failing %d in-flight requests", reason, len(self._streams))
        for s in self._streams.values():
            if not s.admitted.done():
                s.admitted.set_exception(CoreUnreachableError(reason))
            else:
                s.queue.put_nowait(EngineDeadError(reason))
        self._streams.clear()  # their generators end on what was just queued; the new core never knew them
        self._unreported.clear()
        self.unreported_frames = 0
        for fut in [*self._calls.values(), self._hello]:
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(reason))
