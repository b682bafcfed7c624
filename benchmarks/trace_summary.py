"""What a torch profiler trace of an engine core says (a Chrome trace from POST /stop_profile, gzipped or not):
the device's busiest kernels, its longest single events, and, for each of the longest waits of the host for the
device (cudaEventSynchronize / cudaStreamSynchronize / cudaDeviceSynchronize), what the device ran during it;
and the host's longest silences (no torch op, no CUDA call on the thread that has the most events: Python
outside torch, such as a Triton compile or a GC pause), with the event that ended each. Made for slow steps: a
step that waits 0.4 s for the GPU names the kernels, copies or graphs that took it, and a step stalled on the
host shows as a silence (a first-launch Triton compile: ~0.5 s, then cuLaunchKernelEx of that kernel).

    python3 benchmarks/trace_summary.py TRACE.json.gz [--top 15] [--waits 5]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def summarise(events: list[dict], top: int = 15, waits: int = 5) -> dict:
    """-> {"device_busy_us", "device_span_us", "device_union_us", "by_name": [(name, total us, count)],
    "longest": [(name, us, start us)],
    "waits": [{"name", "us", "start", "device": [(name, overlapped us)]}]} (times in the trace's us)."""
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    total, count = Counter(), Counter()
    for e in dev:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    syncs = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("name") in SYNCS), key=lambda e: e["dur"], reverse=True
    )
    out_waits = []
    for w in syncs[:waits]:
        a, b = w["ts"], w["ts"] + w["dur"]
        ran = Counter()
        for e in dev:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                ran[e["name"]] += overlap
        out_waits.append({"name": w["name"], "us": w["dur"], "start": a, "device": ran.most_common(top)})
    longest = sorted(dev, key=lambda e: e["dur"], reverse=True)[:top]
    return {
        "device_busy_us": sum(e["dur"] for e in dev),
        "device_span_us": max(e["ts"] + e["dur"] for e in dev) - min(e["ts"] for e in dev) if dev else 0.0,
        "device_union_us": busy_union(dev),
        "by_name": [(n, t, count[n]) for n, t in total.most_common(top)],
        "longest": [(e["name"], e["dur"], e["ts"]) for e in longest],
        "waits": out_waits,
        "silences": host_silences(events, waits),
    }


def busy_union(dev: list[dict]) -> float:
    """Time with at least one device event running (events on several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for e in sorted(dev, key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def host_silences(events: list[dict], n: int) -> list[tuple[float, float, str]]:
    """The n longest stretches with no host event on the busiest host thread (the step loop's) ->
    [(us, start us, the name of the event that ended it)]."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS]
    if not host:
        return []
    tid = Counter(e.get("tid") for e in host).most_common(1)[0][0]
    host = sorted((e for e in host if e.get("tid") == tid), key=lambda e: e["ts"])
    gaps, end = [], host[0]["ts"]
    for e in host:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
        end = max(end, e["ts"] + e["dur"])
    return sorted(gaps, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--waits", type=int, default=5)
    args = ap.parse_args()
    s = summarise(load(args.trace), args.top, args.waits)
    span = s["device_span_us"]
    union = s["device_union_us"]
    print(
        f"device busy {s['device_busy_us'] / 1e3:.1f} ms in all (summed over events); busy {union / 1e3:.1f} ms of"
        f" the {span / 1e3:.1f} ms from its first event to its last ({union / max(span, 1):.0%})"
    )
    print("\nbusiest on the device (total ms, calls, name):")
    for name, us, n in s["by_name"]:
        print(f"  {us / 1e3:9.3f}  {n:6d}  {name[:110]}")
    print("\nlongest device events (ms, start ms, name):")
    for name, us, ts in s["longest"]:
        print(f"  {us / 1e3:9.3f}  {ts / 1e3:10.1f}  {name[:110]}")
    for w in s["waits"]:
        print(f"\nthe host waited {w['us'] / 1e3:.1f} ms in {w['name']} at {w['start'] / 1e3:.1f} ms; the device ran:")
        for name, us in w["device"]:
            print(f"  {us / 1e3:9.3f}  {name[:110]}")
    print("\nthe host's longest silences on the step loop's thread (ms, start ms, the event that ended it):")
    for us, ts, name in s["silences"]:
        print(f"  {us / 1e3:9.3f}  {ts / 1e3:10.1f}  {name[:110]}")


if __name__ == "__main__":
    main()
