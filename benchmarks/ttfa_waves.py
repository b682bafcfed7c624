"""TTFA of a `bench serve` report split into the first wave (the closed loop's first C requests, which all
arrive at once) and the steady state after it; where the report has the requests' send times (`sent_at`),
also TTFA by the second of the point in which each request was sent, to line up with the server's logs.

Usage: python3 benchmarks/ttfa_waves.py REPORT.json[.gz] ...
"""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np


def main(paths: list[str]) -> int:
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            report = json.load(f)
        for res in report["results"]:
            c = int(res["summary"]["load"])
            reqs = sorted(res["requests"], key=lambda r: int(r["request_id"].rsplit("-", 1)[1]))
            t = np.array([r["ttfa_s"] for r in reqs if r["ttfa_s"] is not None])
            first, rest = t[:c], t[c:]
            print(
                f"{path} @{c}: all p50 {np.median(t):.3f} p99 {np.percentile(t, 99):.3f} s | first {len(first)}: "
                f"p50 {np.median(first):.3f} | after ({len(rest)}): p50 {np.median(rest):.3f} "
                f"p95 {np.percentile(rest, 95):.3f} p99 {np.percentile(rest, 99):.3f} s"
            )
            sent = [(r["sent_at"], r["ttfa_s"]) for r in reqs if r.get("sent_at") and r["ttfa_s"] is not None]
            if sent:
                _by_second(sent)
    return 0


def _by_second(sent: list[tuple[float, float]]) -> None:
    """One line per second of send time: requests sent, TTFA p50 / p99 / max of those requests."""
    t0 = min(s for s, _ in sent)
    by: dict[int, list[float]] = {}
    for s, ttfa in sent:
        by.setdefault(int(s - t0), []).append(ttfa)
    print(f"  sent from {t0:.3f} (epoch s); second: requests sent, TTFA p50 / p99 / max (s)")
    for sec in sorted(by):
        v = np.array(by[sec])
        print(f"  {sec:4d}: {len(v):5d}  {np.median(v):.3f} / {np.percentile(v, 99):.3f} / {v.max():.3f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
