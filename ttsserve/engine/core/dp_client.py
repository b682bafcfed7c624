"""DPClient: the EngineClient of an API server in front of N data-parallel engine cores (one per GPU).

It holds one CoreClient per core and sends each request to one of them:
- Least outstanding work. A core's load is the frames it has yet to deliver (engine/load.py), which it
  reports with its outputs (`outstanding_frames`, at most proc.STATS_INTERVAL_S old), plus the estimated
  frames of this API server's requests that report does not count yet (CoreClient.unreported_frames).
  Request counts would mislead: TTS requests differ a hundredfold in length.
- Prefix-cache affinity. A voice with an audio-code prompt (a saved reference recording: hundreds of prompt
  positions whose KV blocks a core caches) prefers one core, the same for every API server (rendezvous
  hashing over the cores that are up), while that core's load is within a slack of the least loaded.
- Failure. A core that dies fails only the requests it admitted (EngineDeadError -> 503); a request that it
  never admitted (CoreUnreachableError) or refused as overloaded is sent to the next core. Cores that are down
  take no requests until their restart is up (the CoreClient reconnects by itself).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator

import numpy as np

from ttsserve.engine.core.client import HANDSHAKE_TIMEOUT_S, CoreClient
from ttsserve.engine.errors import CoreUnreachableError, EngineDeadError, EngineOverloadedError
from ttsserve.engine.load import estimate_frames
from ttsserve.engine.synthesis import AudioOutput
from ttsserve.params import SynthesisRequest

logger = logging.getLogger("ttsserve.dp_client")

# The preferred core of a voice takes its request while its load exceeds the least loaded core's by at most
# AFFINITY_SLACK of that load, or AFFINITY_MIN_FRAMES (about 22 s of audio) when the cores are near idle:
# the imbalance a cached prompt (hundreds of positions not prefilled again) is worth.
AFFINITY_SLACK = 0.25
AFFINITY_MIN_FRAMES = 1024
# stats() sums these over the cores; the rest (ratios, times, histograms) are per core only (stats["cores"]).
_ADDITIVE = (
    "num_running",
    "num_waiting",
    "num_swapped",
    "num_syntheses",
    "num_free_blocks",
    "num_blocks",
    "outstanding_frames",
    "steps_total",
    "frames_total",
    "num_preemptions_total",
    "num_swaps_total",
)


class DPClient:
    """The engine as seen from one API server, over the cores at `addresses` (index i = core i)."""

    def __init__(
        self,
        addresses: list[str],
        index: int = 0,
        stall_timeout_s: float = 60.0,
        handshake_timeout_s: float | None = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        assert addresses, "at least one engine core"
        self.clients = [CoreClient(a, index, stall_timeout_s, handshake_timeout_s) for a in addresses]
        self._next = 0  # tie-break rotation, so equal loads still spread

    @property
    def sample_rate(self) -> int:
        return self.clients[0].sample_rate

    @property
    def model_name(self) -> str:
        return self.clients[0].model_name

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.clients))

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        await asyncio.gather(*(c.shutdown(drain_timeout_s) for c in self.clients))

    @property
    def ready(self) -> bool:
        return any(c.ready for c in self.clients)

    @property
    def dead(self) -> bool:
        return all(c.dead for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        if not self.dead:
            return None
        return "; ".join(f"core {i}: {c.dead_reason}" for i, c in enumerate(self.clients))

    @property
    def stalled(self) -> bool:
        return self.dead and any(c.stalled for c in self.clients)

    def cores(self) -> list[dict]:
        return [c.core_state(i) for i, c in enumerate(self.clients)]

    # ---- routing -----------------------------------------------------------------------------------
    def load(self, i: int) -> int:
        """Core i's outstanding frames: its last report plus this server's requests the report misses."""
        return self.clients[i].outstanding_frames

    def choose(self, req: SynthesisRequest, frames: int, exclude: set[int] = frozenset()) -> int | None:
        """The core for `req` (None: no core can take it now)."""
        up = [i for i, c in enumerate(self.clients) if c.ready and i not in exclude]
        if not up:
            return None
        n = len(self.clients)
        loads = {i: self.load(i) for i in up}
        least = min(up, key=lambda i: (loads[i], (i - self._next) % n))
        self._next = (least + 1) % n
        if req.voice.spk_smp is not None and len(up) > 1:
            key = req.voice.key
            preferred = max(up, key=lambda i: hashlib.sha1(f"{key}/{i}".encode()).digest())
            if loads[preferred] - loads[least] <= max(AFFINITY_SLACK * loads[least], AFFINITY_MIN_FRAMES):
                return preferred
        return least

    # ---- requests ----------------------------------------------------------------------------------
    async def generate(self, req: SynthesisRequest) -> AsyncIterator[AudioOutput]:
        """The EngineClient contract, on the chosen core; a core that did not admit the request passes it on."""
        frames = estimate_frames(req)
        tried: set[int] = set()
        while True:
            i = self.choose(req, frames, tried)
            if i is None:
                if self.dead:
                    raise EngineDeadError(self.dead_reason)
                raise EngineOverloadedError("no engine core is accepting requests (starting or full)")
            stream = self.clients[i].generate(req, frames)
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return
            except EngineOverloadedError as e:
                if isinstance(e, EngineDeadError) and not isinstance(e, CoreUnreachableError):
                    raise  # admitted, then lost with its core
                tried.add(i)
                logger.info("core %d did not take request %s (%s): trying another", i, req.request_id, e)
                continue
            break
        try:
            yield first
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(c.abort(request_id) for c in self.clients))

    def stats(self) -> dict:
        """Sums over the cores of the counts (_ADDITIVE), each core's own stats under "cores" ({"0": {...}}),
        num_streams: this server's requests in flight."""
        per_core = {str(i): c.stats() for i, c in enumerate(self.clients)}
        total = {k: sum(s.get(k, 0) for s in per_core.values()) for k in _ADDITIVE}
        live = [s for s in per_core.values() if "num_blocks" in s]
        for key in ("kv_cache_usage", "step_time_ms_ema"):  # ratios and times: the mean over the live cores
            total[key] = float(np.mean([s.get(key, 0.0) for s in live])) if live else 0.0
        total["num_streams"] = sum(s.get("num_streams", 0) for s in per_core.values())
        return dict(total, cores=per_core, num_cores_ready=sum(c.ready for c in self.clients))

    def memory_report(self) -> str:
        return "; ".join(f"core {i}: {c.memory_report()}" for i, c in enumerate(self.clients))

    async def start_profile(self) -> None:
        await asyncio.gather(*(c.start_profile() for c in self.clients))

    async def stop_profile(self) -> list[str]:
        return [p for paths in await asyncio.gather(*(c.stop_profile() for c in self.clients)) for p in paths]

    # ---- voices (every core has the same model: any live one answers) --------------------------------
    def _any(self) -> CoreClient:
        return next((c for c in self.clients if c.ready), self.clients[0])

    def random_speaker(self, seed: int) -> np.ndarray:
        return self._any().random_speaker(seed)

    def parse_speaker(self, s: str) -> np.ndarray:
        return self._any().parse_speaker(s)

    def encode_reference_audio(self, wav: np.ndarray, sample_rate: int) -> np.ndarray:
        return self._any().encode_reference_audio(wav, sample_rate)
