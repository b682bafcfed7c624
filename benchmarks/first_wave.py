"""The first-wave penalty of the engine alone (issue 14): after Engine.__init__ (on CUDA: graph capture and
warm_up), waves of N simultaneous requests of F frames; per wave TTFA min/p50/p99, step times and the step's
phases per step. The plan is a list of items: w (a wave) or sN (sleep N seconds, an idle server).

Usage: python3 benchmarks/first_wave.py DEVICE SIZE N FRAMES "w w s10 w w" [nowide]
  e.g. python3 benchmarks/first_wave.py cuda real 128 200 "w w s10 w w"   (r31)
  nowide: warm up without warm_up.py's wide wave (r30: wave 1 waited 325 ms for first audio, wave 2 168 ms)
  (cpu tiny 16 60 "w w": a smoke run; on the CPU the engine is warmed up here by hand)
"""
import dataclasses
import statistics
import sys
import time

sys.path.insert(0, "benchmarks")
import gpu_bench as gb
from ttsserve.model.chattts import load_model
import ttsserve.engine.warm_up as wu
from ttsserve.engine.core.heap import freeze_startup_heap

dev, size, n, frames, plan = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split()
if "nowide" in sys.argv: wu.WIDE_WAVE_CAP = 0
gb.SETUP.update(device=dev, dummy_size=size, dtype="bfloat16" if dev == "cuda" else "float32")
cfg = gb.model_config(max_num_seqs=max(n, 8))
model = load_model(cfg)
e = gb.make_engine(model, max_num_seqs=max(n, 8))
if dev != "cuda":
    wu.warm_up(e)
freeze_startup_heap("probe")
def snap():
    return dataclasses.asdict(e.timings), dataclasses.asdict(e.runner.timings)
w = 0
for item in plan:
    if item.startswith("s"):
        time.sleep(float(item[1:])); print("slept", item[1:], flush=True); continue
    w += 1
    gb.sync(); t0 = time.perf_counter()
    a0, r0 = snap(); s0 = e.counters.steps
    ids = gb.submit(e, n, frames, seed=100 * w)
    st, recs, pending = [], {rid: None for rid in ids}, set(ids)
    while pending:
        a = time.perf_counter()
        outs = e.step()
        st.append((time.perf_counter() - a) * 1e3)
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id in recs and o.samples.size and recs[o.request_id] is None:
                recs[o.request_id] = now
            if o.finished:
                pending.discard(o.request_id)
    a1, r1 = snap(); ns = max(1, e.counters.steps - s0)
    t = sorted(v for v in recs.values() if v is not None)
    ph = " ".join(f"{k[:-3]} {(a1[k]-a0[k])/ns:.2f}" for k in a1 if k.endswith("_ms"))
    rp = " ".join(f"{k} {(r1[k]-r0[k])/ns:.2f}" for k in r1 if isinstance(r1[k], float))
    print(f"wave {w}: ttfa min {t[0]*1e3:.0f} p50 {t[len(t)//2]*1e3:.0f} p99 {t[int(len(t)*.99)]*1e3:.0f} ms; steps {len(st)}; "
          f"first-20 {[round(x,1) for x in st[:20]]}; mean {statistics.mean(st):.2f} max {max(st):.1f} ms; "
          f"total {time.perf_counter()-t0:.2f} s\n   phases/step: {ph}\n   runner/step: {rp}", flush=True)
