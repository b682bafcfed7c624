"""The engine-core process: EngineCoreProc runs an EngineCore (engine_core.py) behind one ZMQ ROUTER socket
that API servers reach.

One thread runs everything that touches the engine: receive (adds, aborts, utility calls), flush admissions,
step, flush outputs. Each flush sends at most one CoreOutputs per API server, so a step's audio for 100
streams of one API server is one message. The EngineCore guards the engine: a request that fails its checks
is rejected by id with its typed error (ErrorInfo), a failing step fails that step's requests and the loop
keeps serving; a utility call that raises answers its caller with the error. Only the DVAE reference encoder
(slow, rare) runs off the loop, on a worker thread whose replies come back to the loop over an inproc socket.

Start-up work the engine left for after ready (deferred CUDA graph captures, engine/deferred_capture.py) runs
on this thread between steps: one capture per turn while idle (the loop polls without sleeping meanwhile, so a
request waits at most one capture), a share of the time while busy.

Liveness: every turn of the loop (every IDLE_POLL_MS when idle, once per step when busy) stamps the
launcher's shared heartbeat, and every API server gets a message at least every HEARTBEAT_INTERVAL_S (stats,
or an empty CoreOutputs), so a loop stuck in a step, or a stopped process, is seen by both although its
connections stay up.

Sockets: ROUTER bound at the ipc address, ROUTER_MANDATORY (a send to an API server that is gone raises, and
its requests are aborted), ROUTER_HANDOVER (a restarted API server reconnecting with its identity takes it
over; its Hello aborts what its predecessor left) and no high-water mark (audio is never dropped; a stalled API
server costs core memory, not other streams' progress).

This module imports torch only inside run_engine_core, after the OpenMP environment is set.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from ttsserve.engine.core.engine_core import EngineCore
from ttsserve.engine.core.heap import FreezeWhenWarm, freeze_startup_heap
from ttsserve.engine.core.messages import (
    Abort,
    AddRequest,
    ArrayMsg,
    CoreInfo,
    CoreOutputs,
    ErrorInfo,
    Hello,
    Rejection,
    RequestOutput,
    UtilityCall,
    UtilityReply,
    client_decoder,
    decode_synthesis,
    encoder,
)
from ttsserve.engine.errors import EngineOverloadedError

logger = logging.getLogger("ttsserve.core")

IDLE_POLL_MS = 50  # how long an idle loop sleeps in poll(); new messages wake it at once
STATS_INTERVAL_S = 0.05  # changed stats reach each API server at most this often
# Every API server hears from the loop at least this often, idle or not: silence means the loop is stuck
# (CoreClient's stall rule), which a connection that stays up (a SIGSTOPped or hung core) cannot tell.
HEARTBEAT_INTERVAL_S = 0.5
MAX_MESSAGES_PER_ITERATION = 4096  # a flood of messages cannot starve the running streams of steps
_RESULTS_ADDRESS = "inproc://ttsserve-utility-results"


@dataclass
class _Batch:
    """What one API server gets in the next CoreOutputs."""

    admitted: list[str] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    stats_version: int = -1  # the stats version it last received
    stats_sent_at: float = 0.0
    sent_at: float = 0.0  # its last CoreOutputs (the heartbeat's clock)


class EngineCoreProc:
    """The step loop of one EngineCore, serving any number of API servers (see the module docstring)."""

    def __init__(self, engine, address: str, drain_timeout_s: float = 30.0, heartbeat=None) -> None:
        """heartbeat: a shared double (multiprocessing.Value) the loop sets to time.monotonic() on every turn,
        for the launcher's stall check; None: not watched."""
        self.engine = engine
        self.heartbeat = heartbeat
        self.core = EngineCore(engine)
        self.drain_timeout_s = drain_timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted API server takes its identity over at once
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(address)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(_RESULTS_ADDRESS)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.results, zmq.POLLIN)
        self.owner: dict[str, bytes] = {}  # request id -> identity of the API server that added it
        self.batches: dict[bytes, _Batch] = {}  # one per API server that said Hello
        self._out = bytearray()  # every CoreOutputs is encoded into it (its capacity kept), then copied by the send
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="ttsserve-utility")
        self._worker_sockets = threading.local()
        self._stats_version = 0  # bumped by every step; the stats are built when a server is due for them
        self._stop_deadline: float | None = None
        self._freeze = FreezeWhenWarm(engine, "engine core")
        self._tokenizer_json = engine.model.tokenizer.to_json()  # once: every Hello gets it (API servers tokenize)
        core = self.core
        self._methods: dict[str, Callable[..., Any]] = {
            "stats": core.stats,
            "memory_report": core.memory_report,
            "start_profile": core.start_profile,
            "stop_profile": core.stop_profile,
            "random_speaker": lambda seed: ArrayMsg.of(core.random_speaker(int(seed))),
            "parse_speaker": lambda s: ArrayMsg.of(core.parse_speaker(s)),
            "encode_reference_audio": lambda wav, rate: ArrayMsg.of(core.encode_reference_audio(wav.array(), rate)),
        }

    # ---- lifecycle ---------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop admitting; the loop ends once in-flight requests finish or the drain timeout passes.
        Safe to call from a signal handler."""
        if self._stop_deadline is None:
            self.core.accepting = False
            self._stop_deadline = time.monotonic() + self.drain_timeout_s

    def run(self) -> None:
        core = self.core
        beat = self.heartbeat
        try:
            while True:
                if beat is not None:
                    beat.value = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
                busy = core.busy()
                if self._stop_deadline is not None and (not busy or time.monotonic() > self._stop_deadline):
                    break
                warming = core.warming and self._stop_deadline is None
                self._receive(0 if busy or warming else IDLE_POLL_MS)
                self._flush()  # admissions and rejections leave before the step
                stepped = core.busy()
                if stepped:
                    self._step()
                if warming and core.background_work(busy=stepped):
                    self._stats_version += 1  # the pending-graphs gauge changed
                self._flush()
                self._freeze.check()
        finally:
            self._close()

    def _close(self) -> None:
        leftover = list(self.owner)
        for rid in leftover:  # the drain timeout passed: tell their API servers instead of going silent
            self.core.abort(rid)
            self._batch(self.owner.pop(rid)).outputs.append(
                RequestOutput(rid, b"", True, 0, "error", [], "the engine core shut down", [])
            )
        self._flush()
        if leftover:
            logger.warning("engine core stopped with %d requests unfinished", len(leftover))
        self.worker.shutdown(wait=True, cancel_futures=True)  # a running encode finishes; its socket is idle
        self.ctx.destroy(linger=1000)  # every socket, the worker's too; the last messages still leave

    # ---- receiving ---------------------------------------------------------------------------------
    def _receive(self, timeout_ms: int) -> None:
        ready = dict(self.poller.poll(timeout_ms))
        if self.results in ready:
            while self.results.poll(0):
                ident, payload = self.results.recv_multipart()
                self._send(ident, payload)
        if self.sock not in ready:
            return
        for _ in range(MAX_MESSAGES_PER_ITERATION):
            try:
                ident, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(ident, payload)

    def _handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = client_decoder.decode(payload)
        except msgspec.DecodeError as e:  # not from our client: nobody to answer
            logger.error("dropped an undecodable message from %r: %s", ident, e)
            return
        if isinstance(msg, AddRequest):
            self._add(ident, msg)
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if self.owner.get(rid) == ident:
                    self.core.abort(rid)
                    del self.owner[rid]
        elif isinstance(msg, UtilityCall):
            self._utility(ident, msg)
        elif isinstance(msg, Hello):
            self._hello(ident, msg)

    def _hello(self, ident: bytes, msg: Hello) -> None:
        self._abort_owned_by(ident)  # requests of an earlier process with this identity have no reader
        self.batches[ident] = _Batch(stats_version=self._stats_version, stats_sent_at=time.monotonic())
        logger.info("API server %d (pid %d) connected", msg.api_server_index, msg.pid)
        core = self.core
        info = CoreInfo(
            os.getpid(),
            core.sample_rate,
            core.model_name,
            core.memory_report(),
            core.hidden_size,
            ArrayMsg.of(core.spk_std),
            ArrayMsg.of(core.spk_mean),
            core.max_queue_len,
            core.stats(),
            self._tokenizer_json,
        )
        self._send(ident, encoder.encode(info))

    def _add(self, ident: bytes, msg: AddRequest) -> None:
        rid = msg.request_id
        batch = self._batch(ident)
        try:
            req = decode_synthesis(msg.request, rid)
            segments = None if msg.segments is None else [m.segment(i) for i, m in enumerate(msg.segments)]
            self.core.add(req, segments)
        except (ValueError, EngineOverloadedError) as e:  # typed: kind and param cross the wire
            batch.rejected.append(Rejection(rid, ErrorInfo.of(e)))
            return
        except Exception as e:  # noqa: BLE001 - EngineCore.add's internal error (logged there)
            batch.rejected.append(Rejection(rid, ErrorInfo("runtime", str(e))))
            return
        self.owner[rid] = ident
        batch.admitted.append(rid)

    # ---- utility calls -----------------------------------------------------------------------------
    def _utility(self, ident: bytes, call: UtilityCall) -> None:
        if call.method == "encode_reference_audio":  # the DVAE encoder: long, keep the streams stepping
            self.worker.submit(self._utility_in_worker, ident, call)
        else:
            self._send(ident, encoder.encode(self._call(call)))

    def _call(self, call: UtilityCall) -> UtilityReply:
        method = self._methods.get(call.method)
        if method is None:
            return UtilityReply(call.call_id, error=ErrorInfo("invalid", f"unknown utility method {call.method!r}"))
        try:
            return UtilityReply(call.call_id, result=method(*call.args))
        except Exception as e:  # the caller gets the error (ValueError stays ValueError); the loop goes on
            if not isinstance(e, ValueError):
                logger.exception("utility call %s failed", call.method)
            return UtilityReply(call.call_id, error=ErrorInfo.of(e))

    def _utility_in_worker(self, ident: bytes, call: UtilityCall) -> None:
        sock = getattr(self._worker_sockets, "sock", None)
        if sock is None:  # sockets are per thread; this one only ever talks to the loop's PULL
            sock = self._worker_sockets.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(_RESULTS_ADDRESS)
        sock.send_multipart([ident, encoder.encode(self._call(call))])

    # ---- stepping and sending ----------------------------------------------------------------------
    def _step(self) -> None:
        # audio the device finished since the last step leaves in mid-step, not at the step's end
        outputs = self.core.step(emit=self._emit)
        self._stats_version += 1
        self._dispatch(outputs)

    def _emit(self, outputs: list) -> None:
        self._dispatch(outputs)
        self._flush()

    def _dispatch(self, outputs: list) -> None:
        for out in outputs:
            ident = self.owner.get(out.request_id)
            if ident is None:  # aborted meanwhile
                continue
            if out.finished:
                del self.owner[out.request_id]
            self._batch(ident).outputs.append(RequestOutput.of(out))

    def _batch(self, ident: bytes) -> _Batch:
        batch = self.batches.get(ident)
        if batch is None:  # a request from a client that skipped Hello (or reconnected): serve it anyway
            batch = self.batches[ident] = _Batch()
        return batch

    def _flush(self) -> None:
        now = time.monotonic()
        stats_raw = None
        for ident, b in list(self.batches.items()):
            stats = None
            # Stats reach each server when they changed, at most every STATS_INTERVAL_S (with its outputs or
            # alone): built and encoded once for every server due, not on every step.
            if b.stats_version != self._stats_version and now - b.stats_sent_at >= STATS_INTERVAL_S:
                if stats_raw is None:
                    stats_raw = msgspec.Raw(encoder.encode(self.core.stats()))
                stats, b.stats_version, b.stats_sent_at = stats_raw, self._stats_version, now
            if not (
                b.admitted or b.rejected or b.outputs or stats is not None or now - b.sent_at >= HEARTBEAT_INTERVAL_S
            ):
                continue
            msg = CoreOutputs(b.admitted, b.rejected, b.outputs, stats)
            b.admitted, b.rejected, b.outputs, b.sent_at = [], [], [], now
            # Encoded into one buffer the loop keeps, then copied into the message by the send: a step's audio
            # is ~0.6 MB a server at 512 streams, and a fresh bytes a message (msgspec growing it as it writes,
            # then zero-copy sends freed by pyzmq's collector thread) took 3.3-4.2 ms a step of 12 such messages
            # against 1.6-2.1 ms this way (benchmarks/core_send_cost.py, 2-core CPU)
            encoder.encode_into(msg, self._out)
            self._send(ident, self._out, copy=True)

    def _send(self, ident: bytes, payload: bytes | bytearray, copy: bool | None = None) -> None:
        """payload copied into the message unless it is large and the caller leaves it alone (copy None: copy
        below 64 KiB); a buffer the caller reuses must pass copy=True."""
        try:
            self.sock.send_multipart([ident, payload], copy=len(payload) < 65536 if copy is None else copy)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._drop_client(ident)

    def _drop_client(self, ident: bytes) -> None:
        n = self._abort_owned_by(ident)
        self.batches.pop(ident, None)
        (logger.warning if n else logger.info)("API server %r is gone: aborted its %d requests", ident, n)

    def _abort_owned_by(self, ident: bytes) -> int:
        rids = [rid for rid, owner in self.owner.items() if owner == ident]
        for rid in rids:
            self.core.abort(rid)
            del self.owner[rid]
        return len(rids)


def run_engine_core(cfg, address: str, ready: Connection, drain_timeout_s: float = 30.0, heartbeat=None) -> int:
    """The core process's main: build the Engine from `cfg` (EngineConfig), bind `address`, report on
    `ready` ("ready", pid) or ("error", message), then serve until SIGTERM (drain, then return 0).

    SIGINT is ignored: the launcher owns Ctrl-C and stops the core after the API servers have drained.
    """
    from ttsserve.runner.cpu_threads import openmp_env_defaults

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    openmp_env_defaults()  # before torch loads: how idle OpenMP threads wait (runner/cpu_threads.py)
    from ttsserve.engine.engine import Engine

    try:
        core = EngineCoreProc(Engine(cfg), address, drain_timeout_s, heartbeat)
    except Exception as e:  # reported to the launcher, which exits with a one-line reason
        logger.exception("the engine core failed to start")
        ready.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    signal.signal(signal.SIGTERM, lambda *_: core.request_stop())

    freeze_startup_heap("engine core", step_loop=True)
    ready.send(("ready", os.getpid()))
    ready.close()
    core.run()
    logger.info("engine core stopped")
    return 0
