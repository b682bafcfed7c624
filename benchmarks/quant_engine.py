"""Engine throughput and memory with and without quantization, every variant in one process.

    python3 benchmarks/quant_engine.py --out DIR [--device cuda] [--batch-sizes 1,256] [--frames 469]
        [--kv-cache-memory 8G] [--variants bf16,int8,awq-int4,fp8-kv]

Each variant is a fresh Engine on the same random real-size checkpoint (`--dummy-size`), run through the
offline bench (ttsserve/bench/offline.py: fixed-length utterances, one warm-up request first). The KV pool is
a fixed budget (`--kv-cache-memory`) so that "streams that fit" compares like with like. Writes
DIR/quant_engine.json after every variant (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from pathlib import Path

import torch

from ttsserve.bench.offline import OfflineSpec, TTSServeBackend, run_offline
from ttsserve.config import EngineConfig
from ttsserve.engine.args import parse_size
from ttsserve.model.cpu_linear import stored_weight_bytes

VARIANTS = {  # name -> (quantization, kv_cache_dtype)
    "bf16": (None, "auto"),
    "int8": ("int8", "auto"),
    "awq-int4": ("awq-int4", "auto"),
    "fp8-kv": (None, "fp8"),
}


def run_variant(name: str, args: argparse.Namespace) -> dict:
    quantization, kv_dtype = VARIANTS[name]
    cfg = EngineConfig(
        load_format="dummy",
        dummy_size=args.dummy_size,
        device=args.device,
        quantization=quantization,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory=args.kv_cache_memory,
        swap_space=0,
        max_num_seqs=max(args.batch_sizes),
    )
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    backend = TTSServeBackend(cfg)
    build_s = time.perf_counter() - t0
    # Warm every chunk shape at every batch size: first-use compilation must not land in one variant's figures.
    spec = OfflineSpec(batch_sizes=args.batch_sizes, frames=args.frames, warmup_frames=min(args.frames, 128))
    results = run_offline(spec, backend, progress=False)
    row = {
        "variant": name,
        "engine_build_s": round(build_s, 2),
        "memory_report": backend.engine.memory_report(),
        "gpt_weight_bytes": stored_weight_bytes(backend.engine.model.gpt),
        "kv_bytes_per_frame": backend.engine.kv_spec.bytes_per_token,
        "kv_frames": backend.engine.kv_spec.num_blocks * backend.engine.kv_spec.block_size,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "runs": [r.summary() for r in results],
    }
    del backend, results
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dummy-size", default="real", choices=["real", "tiny"])
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 256])
    ap.add_argument("--frames", type=int, default=469)
    ap.add_argument("--kv-cache-memory", type=parse_size, default=parse_size("8G"))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = args.variants.split(",")
    if unknown := sorted(set(names) - set(VARIANTS)):
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        rows.append(run_variant(name, args))
        (args.out / "quant_engine.json").write_text(json.dumps(rows, indent=1))
        for r in rows[-1]["runs"]:
            print(
                f"{name:9s} batch {r['load']:4d}: {r['audio_seconds_per_s']:8.1f} audio-s/s  "
                f"latency p50 {r['latency_s']['p50']:.2f} s  | {rows[-1]['memory_report']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
