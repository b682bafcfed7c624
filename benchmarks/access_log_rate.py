"""Requests the API servers started per second, from a server log's access lines (`ttsserve.access` JSON: the
line is written when the response starts, `ms` after the handler began), to set beside the client's send times
(`python3 benchmarks/ttfa_waves.py REPORT.json`): a second in which the client sent many requests but the
handlers started few is time spent between the client and the handler (sockets, parsing, a busy event loop).

    python3 benchmarks/access_log_rate.py SERVER.log [--path /v1/audio/speech] [--seconds 30]

One line per second from the first request: handler starts, the fewest and most any API server took (of those
that took one), and the access `ms` p50 / max of those requests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from collections import defaultdict

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \[(api\d+)\] ttsserve\.access: (\{.*\})$")


def handler_starts(lines, path: str) -> list[tuple[float, str, float]]:
    """(start, API server, ms) of every access line for `path`; start = the line's time - ms (epoch s)."""
    out = []
    for line in lines:
        m = _LINE.match(line.rstrip("\n"))
        if not m:
            continue
        rec = json.loads(m[3])
        if rec.get("path") != path or "ms" not in rec:
            continue
        t = dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append((t - rec["ms"] / 1e3, m[2], rec["ms"]))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--path", default="/v1/audio/speech")
    ap.add_argument("--seconds", type=int, default=30)
    a = ap.parse_args()
    with open(a.log, errors="replace") as f:
        starts = handler_starts(f, a.path)
    if not starts:
        print("no access lines for", a.path)
        return
    t0 = starts[0][0]
    by = defaultdict(list)
    for t, api, ms in starts:
        by[int(t - t0)].append((api, ms))
    print(f"first handler start {t0:.3f} (epoch s, the log's clock)")
    print("second: handler starts, min / max per API server that took any, access ms p50 / max")
    for sec in sorted(by)[: a.seconds]:
        rows = by[sec]
        per_api = defaultdict(int)
        for api, _ in rows:
            per_api[api] += 1
        ms = sorted(m for _, m in rows)
        counts = per_api.values()
        spread = f"{min(counts):4d} / {max(counts):4d}"
        print(f"  {sec:4d}: {len(rows):5d}  {spread}  {ms[len(ms) // 2]:7.1f} / {ms[-1]:7.1f}")


if __name__ == "__main__":
    main()
