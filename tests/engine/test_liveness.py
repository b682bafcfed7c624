"""The liveness rule both engine clients share: lost wins; silence past the stall timeout is a stall, but only
once watching started."""

from __future__ import annotations

from ttsserve.engine.core.liveness import Liveness


def test_lost_stalled_and_alive(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("ttsserve.engine.core.liveness.time.monotonic", lambda: now[0])
    live = Liveness(2.0, "the loop has not turned")
    now[0] += 10
    assert live.dead_reason is None  # not started: not stalled
    live.watching = True
    live.sign()
    now[0] += 1.5
    assert live.dead_reason is None and not live.stalled
    now[0] += 1.0
    assert live.dead_reason == "the loop has not turned in 2 s" and live.stalled
    live.sign()
    assert live.dead_reason is None
    live.lost = "the engine core process is gone"
    assert live.dead_reason == "the engine core process is gone" and not live.stalled
