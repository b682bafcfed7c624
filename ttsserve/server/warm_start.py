"""An API server's one-time costs, paid before it accepts connections.

A fresh API server's first request imported anyio's asyncio backend (the streaming response's task group),
the speaker module and numpy.random (the built-in voices' speaker vectors), and opened its encoder's codec:
about 100 ms of CPU on the 2-core CPU machine against 20 ms for the next request (py-spy). A burst's first
requests all queue behind it in that server's event loop, reach the engine a step or more late and then
wait for its next admission (admission_interval): on an H200 a fresh server's first wave of 128 requests
heard its first audio 40-120 ms later than a later wave did (benchmarks/first_wave.py). The text path
(normalizers, tokenizer) is warmed by the engine client itself (text/segments.warm_up_text_path).
"""

from __future__ import annotations

import logging
import time

import anyio
import numpy as np

from ttsserve.audio.encode import FORMATS, StreamingEncoder, validate_format
from ttsserve.server.voices import BUILTIN_VOICES

logger = logging.getLogger("ttsserve.server")


async def warm_up_api_server(state) -> float:
    """Exercise the per-process first-use paths of a request (no engine work, no metrics, no rate limit);
    returns the seconds it took. `state`: the app's ServerState. Never raises: it only saves time, and what
    fails here fails again, with a proper error response, in the request that needs it."""
    t0 = time.perf_counter()
    try:
        await _first_uses(state)
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning(
            "the API server's warm-up failed (%s: %s); its first requests pay the one-time costs", type(e).__name__, e
        )
    seconds = time.perf_counter() - t0
    logger.debug("API server request path warmed up in %.3f s", seconds)
    return seconds


async def _first_uses(state) -> None:
    async with anyio.create_task_group() as tg:  # anyio imports its backend on first use
        tg.start_soon(anyio.sleep, 0)
    for name in BUILTIN_VOICES:
        await state.resolve_voice(name)  # cached per seed: later requests for these voices compute nothing
    silence = np.zeros(2400, dtype=np.float32)
    for fmt in FORMATS:
        try:
            validate_format(fmt)
        except ValueError:  # a codec this PyAV build lacks: requests for it get a 400 anyway
            continue
        encoder = StreamingEncoder(fmt)
        encoder.write(silence)
        encoder.close()
