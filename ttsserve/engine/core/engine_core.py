"""EngineCore: the synchronous engine loop's body, with no transport. The in-process client (AsyncEngine) runs
it on its step thread; the engine-core process (proc.py) runs it behind a ZMQ socket. Everything that guards
the Engine lives here once: admission (shutting-down check, queue bound, duplicate ids, input errors typed),
the busy test, the guarded step, which fails that step's requests on an exception and keeps serving, and the
engine's deferred start-up work (graph captures) between steps.

Not thread-safe: one thread owns an EngineCore, as one thread owns its Engine. The one exception is
encode_reference_audio (the DVAE encoder, slow), which fronts run on another thread: it never overlaps a
graph capture, which forbids other threads' device allocations.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from ttsserve.constants import MODEL_NAME, SAMPLE_RATE, speaker_stats
from ttsserve.engine.errors import EngineOverloadedError, InvalidRequestError
from ttsserve.engine.load import OutstandingWork, estimate_frames
from ttsserve.engine.profiler import CoreProfiler, profiler_dir
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest
from ttsserve.text.segments import Segment

logger = logging.getLogger("ttsserve.engine")


class EngineCore:
    """One Engine behind the checks every front shares (see the module docstring)."""

    sample_rate = SAMPLE_RATE
    model_name = MODEL_NAME

    def __init__(self, engine) -> None:
        self.engine = engine
        self.max_queue_len: int = engine.cfg.max_queue_len
        self.accepting = True  # False once shutting down: new requests get EngineOverloadedError
        model = engine.model
        std, mean = speaker_stats(model.spk_stat, model.hidden_size)
        # float16 [hidden] each: random_speaker's statistics (also sent to API servers, which sample locally)
        self.spk_std, self.spk_mean = np.asarray(std, np.float16), np.asarray(mean, np.float16)
        self.work = OutstandingWork()  # frames still to deliver: the load data-parallel routing weighs
        self._device_side_work = threading.Lock()  # held by encode_reference_audio and by a graph capture
        self.profiler = CoreProfiler(profiler_dir())  # /start_profile, /stop_profile: engine/profiler.py

    # ---- requests ----------------------------------------------------------------------------------
    def add(self, req: SynthesisRequest, segments: list[Segment] | None = None) -> str:
        """Admit `req` (its request_id set by the client's input processor) -> its id. Raises
        EngineOverloadedError (shutting down, queue full), InvalidRequestError (a duplicate id, input the
        engine refuses; nothing is left queued), RuntimeError for an internal failure (logged)."""
        rid = req.request_id
        assert rid, "the input processor assigns every request id"
        if not self.accepting:
            raise EngineOverloadedError("the engine is shutting down")
        n = self.engine.num_syntheses
        if n >= self.max_queue_len:
            raise EngineOverloadedError(f"too many requests in flight ({n})")
        if self.engine.has_synthesis(rid):
            raise InvalidRequestError(f"request_id {rid!r} is already in use", "request_id")
        try:
            rid = self.engine.add_synthesis(req, segments)
            self.work.add(rid, estimate_frames(req))
            return rid
        except InvalidRequestError:
            raise
        except ValueError as e:  # the engine's own checks (prompt room, prepared ids): no single field
            raise InvalidRequestError(str(e)) from None
        except Exception as e:  # a front-end bug must reject this request, not kill the loop
            logger.exception("add_synthesis failed for %s", rid)
            raise RuntimeError(f"internal error: {type(e).__name__}: {e}") from e

    def abort(self, rid: str) -> None:
        """Its sequences leave the batch and free their blocks at the next step (unknown ids: no-op)."""
        self.work.remove(rid)
        self.engine.abort(rid)

    # ---- the loop ----------------------------------------------------------------------------------
    def busy(self) -> bool:
        # Aborted requests are released by the scheduler's next step, so step while any remain.
        return self.engine.has_unfinished() or self.engine.scheduler.has_unfinished_requests()

    def step(self, emit: Callable[[list[AudioOutput]], None] | None = None) -> list[AudioOutput]:
        """One engine step (emit: Engine.step's mid-step output callback). An exception fails every
        synthesis with one final error output each and the engine keeps serving."""

        def emit_counted(outs: list[AudioOutput]) -> None:
            self._count(outs)
            emit(outs)

        try:
            return self._count(self.engine.step(emit=None if emit is None else emit_counted))
        except Exception as e:  # one guarded place: fail this step's requests, keep serving
            logger.exception("engine step failed")
            return self.fail_all(f"internal error: {type(e).__name__}: {e}")

    @property
    def warming(self) -> bool:
        """Start-up work is left for between steps (deferred graph captures): the loop should not idle."""
        return self.engine.graphs_pending > 0

    def background_work(self, busy: bool) -> bool:
        """One deferred graph capture, if one is due (busy: requests are running; they get most of the time)
        and no encode_reference_audio runs on another thread -> whether one ran. Call between steps only."""
        if not self.engine.graphs_pending or not self._device_side_work.acquire(blocking=False):
            return False
        try:
            return self.engine.run_deferred(busy)
        finally:
            self._device_side_work.release()

    def fail_all(self, message: str) -> list[AudioOutput]:
        """Abort every synthesis -> one final error output each."""
        return self._count(self.engine.fail_all(message))

    def _count(self, outs: list[AudioOutput]) -> list[AudioOutput]:
        for o in outs:
            self.work.delivered(o.request_id, len(o.samples), o.finished)
        return outs

    # ---- utilities ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The Engine's stats plus outstanding_frames (engine/load.py): frames its admitted syntheses have
        yet to deliver, by their estimates."""
        return dict(self.engine.stats(), outstanding_frames=self.work.total)

    def memory_report(self) -> str:
        return self.engine.memory_report()

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> str:
        """-> the trace's path."""
        return self.profiler.stop()

    @property
    def hidden_size(self) -> int:
        return self.engine.model.hidden_size

    def random_speaker(self, seed: int) -> np.ndarray:
        """float16 [hidden]: the speaker vector of `seed` (the same on every client)."""
        from ttsserve.text.speaker import sample_random_speaker

        return sample_random_speaker(self.spk_std, self.spk_mean, int(seed))

    def parse_speaker(self, s: str) -> np.ndarray:
        from ttsserve.text.speaker import decode_speaker

        return decode_speaker(s, dim=self.hidden_size)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        """A reference recording -> int32 [num_vq, P] audio-code prompt (the DVAE encoder; slow)."""
        from ttsserve.engine.voice_encode import encode_reference

        try:
            with self._device_side_work:  # waits for a graph capture in progress (a fraction of a second)
                return encode_reference(self.engine.model, wav, int(sample_rate))
        finally:
            if self.engine.model.device.type == "cpu":  # called from a worker thread: let its OpenMP team go
                from ttsserve.runner.cpu_threads import release_openmp_pool

                release_openmp_pool()
