"""Where a served run's time to first audio goes, by when its requests were sent: the client's TTFA (a `bench
serve` report) against the API servers' access log (the server's log: an `access` line's `admit_ms` runs from the
request's arrival in the app to its admission, a `synthesis_done` line's `ttfa_ms` from there to the first audio),
joined on the X-Request-ID the bench sends.

    python3 benchmarks/ttfa_split.py REPORT_DIR SERVER_LOG [--bin 1.0]

One row per bin of send times: requests joined, then p50 / p99 of the client's TTFA, the app's (admit_ms + ttfa_ms),
the admitted request's (ttfa_ms), the time in the app before admission (admit_ms: the API server's event loop's
queue, middleware, the body's validation, the voice) and outside the app (client - app: the accept, the parse, the
response's way back, the load generator).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def server_times(log: Path) -> dict[str, dict]:
    """request id -> {"admit_ms": arrival -> admission, "ttfa_ms": admission -> first audio}, from the log's JSON
    lines."""
    out: dict[str, dict] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "' not in line:
            continue
        try:
            d = json.loads(line[line.index("{") :])
        except ValueError:
            continue
        if d.get("event") == "access" and d.get("admit_ms") is not None:
            out.setdefault(d["request_id"], {})["admit_ms"] = d["admit_ms"]
        elif d.get("event") == "synthesis_done" and d.get("ttfa_ms") is not None:
            out.setdefault(d["request_id"], {})["ttfa_ms"] = d["ttfa_ms"]
    return out


def split(report: dict, times: dict[str, dict], bin_s: float) -> list[dict]:
    """Rows by send-time bin of the requests found in both (ok, streamed, both server figures)."""
    reqs = report["results"][0]["requests"]
    t0 = min(r["sent_at"] for r in reqs)
    bins: dict[int, list[tuple[float, float, float]]] = {}
    for r in reqs:
        s = times.get(r["request_id"], {})
        if r["status"] == "ok" and r["ttfa_s"] is not None and "admit_ms" in s and "ttfa_ms" in s:
            key = int((r["sent_at"] - t0) // bin_s)
            bins.setdefault(key, []).append((r["ttfa_s"], s["admit_ms"] / 1e3, s["ttfa_ms"] / 1e3))
    rows = []
    for key, v in sorted(bins.items()):
        client, admit, admitted = (np.array(x) for x in zip(*v))
        row = {"from_s": key * bin_s, "n": len(v)}
        for name, x in (
            ("client", client),
            ("app", admit + admitted),
            ("admitted", admitted),
            ("before_admission", admit),
            ("outside_app", client - admit - admitted),
        ):
            row[name] = (float(np.percentile(x, 50)), float(np.percentile(x, 99)))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report_dir", type=Path)
    ap.add_argument("server_log", type=Path)
    ap.add_argument("--bin", type=float, default=1.0, help="seconds of send time per row")
    a = ap.parse_args()
    report = json.loads((a.report_dir / "report.json").read_text())
    rows = split(report, server_times(a.server_log), a.bin)
    names = ("client", "app", "admitted", "before_admission", "outside_app")
    print("sent from (s) | n | " + " | ".join(f"{n} p50 / p99 (s)" for n in names))
    for r in rows:
        print(f"{r['from_s']:g} | {r['n']} | " + " | ".join(f"{r[n][0]:.3f} / {r[n][1]:.3f}" for n in names))
    if not rows:
        print("no request of the report is in the log (a log without access lines, or a bench without X-Request-ID)")


if __name__ == "__main__":
    main()
