"""benchmarks/trace_summary.py on a trace with a known slow wait: the kernel that ran during the host's longest
sync is named first, with the time it overlapped the wait, and host-only events never count as device time; and
on one with a known host silence (a compile before a launch), found on the step loop's thread."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_the_kernel_under_the_longest_wait_is_named(tmp_path):
    events = [
        _x("aten::mm", "cpu_op", 0, 50),  # host only: not device time
        _x("gemm", "kernel", 0, 10),
        _x("gemm", "kernel", 20, 10),
        _x("cudaEventSynchronize", "cuda_runtime", 35, 400),  # waits from 35 to 435
        _x("slow_kernel", "kernel", 30, 390),  # 30..420: 385 us inside the wait
        _x("Memcpy DtoH", "gpu_memcpy", 425, 20),  # 425..445: 10 us inside it
        _x("cudaStreamSynchronize", "cuda_runtime", 500, 5),
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trace_summary.summarise(trace_summary.load(str(path)), top=5, waits=2)
    assert s["device_busy_us"] == 10 + 10 + 390 + 20
    assert s["device_span_us"] == 445  # 0..445
    assert s["device_union_us"] == 10 + 400 + 20  # 0..10, 20..420 (gemm and slow_kernel overlap), 425..445
    assert s["by_name"][0] == ("slow_kernel", 390, 1) and ("gemm", 20, 2) in s["by_name"]
    assert s["longest"][0] == ("slow_kernel", 390, 30)
    first = s["waits"][0]
    assert (first["name"], first["us"]) == ("cudaEventSynchronize", 400)
    assert first["device"] == [("slow_kernel", 385), ("Memcpy DtoH", 10)]
    assert s["waits"][1]["device"] == []  # nothing ran during the short one


def test_a_host_silence_is_found_with_the_launch_that_ended_it():
    loop, other = 1, 2
    events = [
        {**_x("aten::empty", "cpu_op", 0, 10), "tid": loop},
        {**_x("cudaGraphLaunch", "cuda_runtime", 20, 5), "tid": loop},
        {**_x("aten::slice", "cpu_op", 30, 2), "tid": loop},
        {**_x("cuLaunchKernelEx", "cuda_driver", 532, 3), "tid": loop},  # 500 us of silence before it
        {**_x("cudaGraphLaunch", "cuda_runtime", 540, 5), "tid": loop},
        {**_x("aten::add", "cpu_op", 100, 2), "tid": other},  # another thread: no silence of the loop's ends here
        _x("paged_decode_kernel", "kernel", 536, 30),  # device events are not host activity
    ]
    assert trace_summary.host_silences(events, 2) == [(500, 32, "cuLaunchKernelEx"), (10, 10, "cudaGraphLaunch")]
