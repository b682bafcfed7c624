"""OpenAI `speed` (0.25..4.0) onto ChatTTS: a `[speed_N]` prompt token plus a pitch-preserving time stretch.

ChatTTS's code prompt carries one of `[speed_0]`..`[speed_9]`; the reference always uses `[speed_5]`
(MODEL.md §2.5). How fast each N speaks is not published, so this module ASSUMES a linear scale of 0.1x per
step around N=5:

    N      0    1    2    3    4    5    6    7    8    9
    rate  0.5  0.6  0.7  0.8  0.9  1.0  1.1  1.2  1.3  1.4

`speed_to_prompt(speed)` picks the N whose assumed rate is nearest to `speed` in log scale (speed 1.0 ->
N=5 exactly) and returns the residual factor speed / rate(N), which the caller applies to the decoded
audio with `time_stretch` / `StreamTimeStretcher` (FFmpeg `atempo`: tempo changes, pitch does not).
If the true rates differ, only the residual is off; measure and adjust SPEED_TOKEN_RATES.
"""

from __future__ import annotations

import math
from fractions import Fraction

import av
import av.filter
import numpy as np

from ttsserve.audio.post import as_mono_float32
from ttsserve.constants import SAMPLE_RATE

MIN_SPEED, MAX_SPEED = 0.25, 4.0
SPEED_TOKEN_RATES: tuple[float, ...] = tuple(round(0.5 + 0.1 * n, 2) for n in range(10))
DEFAULT_SPEED_TOKEN = 5
# atempo's best-quality range per stage; factors outside it are split into a chain of stages.
_ATEMPO_MIN, _ATEMPO_MAX = 0.5, 2.0
# Push audio into the graph in frames of this many samples: atempo emits output about one input frame
# behind, so small frames keep the streaming latency at tens of milliseconds instead of a whole chunk.
_PUSH_FRAME = 1024


def validate_speed(speed: float) -> float:
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (MIN_SPEED <= speed <= MAX_SPEED):
        raise ValueError(f"speed must be a number in [{MIN_SPEED}, {MAX_SPEED}], got {speed!r}")
    return float(speed)


def speed_to_prompt(speed: float) -> tuple[int, float]:
    """Map an OpenAI speed to (N of the `[speed_N]` token, residual time-stretch factor).

    residual = speed / SPEED_TOKEN_RATES[N]; > 1 means "make faster" (shorter audio). speed 1.0 -> (5, 1.0).
    """
    speed = validate_speed(speed)
    log_dist = [abs(math.log(speed / rate)) for rate in SPEED_TOKEN_RATES]
    n = min(range(len(SPEED_TOKEN_RATES)), key=lambda i: (log_dist[i], abs(i - DEFAULT_SPEED_TOKEN)))
    return n, speed / SPEED_TOKEN_RATES[n]


def speed_token(n: int) -> str:
    """The prompt token string for N (0..9), e.g. "[speed_5]"."""
    if not (0 <= n < len(SPEED_TOKEN_RATES)):
        raise ValueError(f"speed token index must be in [0, {len(SPEED_TOKEN_RATES) - 1}], got {n}")
    return f"[speed_{n}]"


def atempo_stages(factor: float) -> list[float]:
    """Split `factor` into atempo stages each within [0.5, 2.0] whose product is `factor`; [] for 1.0."""
    stages: list[float] = []
    while factor > _ATEMPO_MAX:
        stages.append(_ATEMPO_MAX)
        factor /= _ATEMPO_MAX
    while factor < _ATEMPO_MIN:
        stages.append(_ATEMPO_MIN)
        factor /= _ATEMPO_MIN
    if abs(factor - 1.0) > 1e-9:
        stages.append(factor)
    return stages


class StreamTimeStretcher:
    """Pitch-preserving tempo change of a stream by `factor` (output duration ~ input duration / factor).

    Args:
        factor: tempo factor in [0.25, 4.0]; 1.0 passes samples through untouched.
        sample_rate: rate of the input (and output) samples.
    `process(chunk [n] float32) -> [m] float32` returns what the filter graph has ready (it holds back
    about one 1024-sample frame per atempo stage); `flush() -> [k] float32` returns the rest. atempo's
    own end-of-stream handling is off by up to a few tens of ms, so `flush` pads with silence or cuts
    its tail so that the total output is round(total_n / factor) samples whenever the tail allows (it
    can only cut what it has not yet returned).
    """

    def __init__(self, factor: float, sample_rate: int = SAMPLE_RATE) -> None:
        self.factor = validate_speed(factor)
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer in Hz, got {sample_rate!r}")
        self.sample_rate = int(sample_rate)
        stages = atempo_stages(self.factor)
        self._graph = self._build_graph(stages) if stages else None
        self._pts = 0  # samples pushed = total input
        self._num_out = 0
        self._flushed = False

    def _build_graph(self, stages: list[float]) -> av.filter.Graph:
        graph = av.filter.Graph()
        nodes = [
            graph.add_abuffer(
                sample_rate=self.sample_rate, format="flt", layout="mono", time_base=Fraction(1, self.sample_rate)
            )
        ]
        nodes += [graph.add("atempo", f"tempo={f!r}") for f in stages]
        nodes.append(graph.add("abuffersink"))
        for src, dst in zip(nodes, nodes[1:]):
            src.link_to(dst)
        graph.configure()
        return graph

    def process(self, chunk: np.ndarray) -> np.ndarray:
        if self._flushed:
            raise ValueError("StreamTimeStretcher.process() called after flush()")
        x = as_mono_float32(chunk)
        if self._graph is None:
            return x
        out: list[np.ndarray] = []
        for start in range(0, x.size, _PUSH_FRAME):
            self._push(x[start : start + _PUSH_FRAME])
            self._pull_into(out)
        y = np.concatenate(out) if out else np.zeros(0, np.float32)
        self._num_out += y.size
        return y

    def flush(self) -> np.ndarray:
        if self._flushed or self._graph is None:
            self._flushed = True
            return np.zeros(0, np.float32)
        self._flushed = True
        self._graph.push(None)
        out: list[np.ndarray] = []
        self._pull_into(out)
        tail = np.concatenate(out) if out else np.zeros(0, np.float32)
        missing = round(self._pts / self.factor) - self._num_out - tail.size
        if missing > 0:
            tail = np.concatenate([tail, np.zeros(missing, np.float32)])
        elif missing < 0:
            tail = tail[: max(0, tail.size + missing)]
        return tail

    def _push(self, x: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = Fraction(1, self.sample_rate)
        self._pts += x.size
        self._graph.push(frame)

    def _pull_into(self, out: list[np.ndarray]) -> None:
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):  # EAGAIN: needs more input; EOF: drained
                return
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))


def time_stretch(x: np.ndarray, factor: float, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Pitch-preserving tempo change of a whole signal: [n] float32 -> [~n / factor] float32."""
    stretcher = StreamTimeStretcher(factor, sample_rate)
    head = stretcher.process(x)
    return np.concatenate([head, stretcher.flush()])
