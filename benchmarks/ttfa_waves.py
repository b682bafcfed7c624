"""TTFA of a `bench serve` report split into the first wave (the closed loop's first C requests, which all
arrive at once) and the steady state after it.

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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
