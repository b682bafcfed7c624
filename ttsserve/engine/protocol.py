"""EngineClient: the contract between the HTTP server and an engine, whatever runs it.

Implementations: engine/core/async_engine.AsyncEngine (the EngineCore on a thread of this process),
engine/core/client.CoreClient (an engine-core process over ZMQ) and the tests' FakeEngine. Both real clients
run requests through the same InputProcessor and the same EngineCore, so they refuse the same inputs with the
same typed errors (engine/errors.py) and produce the same audio for the same seeded request.

generate(req) contract: InvalidRequestError (bad input, `param` naming the field), EngineOverloadedError
(not ready, shutting down, queue full) or EngineDeadError (the engine is gone) are raised before the first
output. Then AudioOutputs stream in order; the last has finished=True and a finish_reason. A consumer that
stops iterating (aclose, cancellation) aborts the request and frees its KV blocks. Outputs carry the
caller's request_id when it gave one, else the id the client assigned.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    sample_rate: int  # Hz of AudioOutput.samples

    @property
    def ready(self) -> bool:
        """Started, accepting requests and alive."""

    @property
    def dead(self) -> bool:
        """True while the engine cannot serve (then dead_reason says why): gone (an in-process engine for
        good; an engine core until the launcher's new core is up), or stalled (its loop has not turned within
        the stall timeout; `stalled` says which, where the client has it)."""

    @property
    def dead_reason(self) -> str | None: ...

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish up to the timeout, abort the rest."""

    def generate(self, req: SynthesisRequest) -> AsyncIterator[AudioOutput]:
        """An async generator of the request's audio (see the module docstring)."""

    async def abort(self, request_id: str) -> None:
        """End the request whose outputs carry `request_id`: its stream's last output is finish_reason
        "abort" and its blocks are freed. Unknown or finished ids: no-op."""

    def stats(self) -> dict[str, Any]:
        """Engine counters (num_running, num_waiting, kv_cache_usage, ...) plus num_streams: this client's
        requests in flight."""

    def memory_report(self) -> str: ...

    async def start_profile(self) -> None:
        """Start the torch profiler in every engine core (engine/profiler.py). InvalidRequestError when
        profiling is off ($TTSSERVE_TORCH_PROFILER_DIR unset) or already running."""

    async def stop_profile(self) -> list[str]:
        """Stop it -> the traces written, one per engine core. InvalidRequestError when it is not running."""

    def cores(self) -> list[dict[str, Any]]:
        """Each engine core's state, for /ready: {"core": i, "ready": bool, "reason": str | None} (one entry
        unless the client spreads requests over data-parallel cores)."""

    def random_speaker(self, seed: int) -> np.ndarray:
        """float16 [hidden]: the speaker vector of `seed`, the same on every call and every client."""

    def parse_speaker(self, s: str) -> np.ndarray:
        """A ChatTTS speaker string -> float16 [hidden]; ValueError if malformed."""

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording -> int32 [num_vq, P] audio-code prompt. Blocking: call it from a worker
        thread. ValueError for unusable audio."""
