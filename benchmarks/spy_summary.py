"""Summarise a py-spy raw (collapsed-stack) profile: the share of samples in which each function is on the
stack (inclusive) and on top (self), ttsserve frames first. Used to break down the engine core's step loop
under served load (docs/benchmarks-history.md):

    py-spy record --pid PID --duration 15 --rate 250 --nonblocking --format raw -o core.raw
    python benchmarks/spy_summary.py core.raw [--top 45] [--match ttsserve]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _name(frame: str) -> str:
    """'step (ttsserve/engine/engine.py:123)' -> 'engine/engine.py:step' (line dropped: one row per function)."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    if "ttsserve/" in path:
        path = path.split("ttsserve/", 1)[1]
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{m['func']}"


def summarise(lines) -> tuple[int, Counter, Counter]:
    total, inclusive, own = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_name(f) for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--match", default="", help="only rows whose name contains this (inclusive table)")
    a = ap.parse_args()
    with open(a.raw) as f:
        total, inclusive, own = summarise(f)
    print(f"{total} samples")
    print("\ninclusive (on the stack)")
    rows = [(k, v) for k, v in inclusive.most_common() if a.match in k]
    for name, n in rows[: a.top]:
        print(f"{100 * n / total:6.1f}%  {name}")
    print("\nself (on top)")
    for name, n in own.most_common(a.top):
        print(f"{100 * n / total:6.1f}%  {name}")


if __name__ == "__main__":
    main()
