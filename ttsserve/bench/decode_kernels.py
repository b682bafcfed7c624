"""Decode-step time and memory of the real-size GPT on CUDA: bf16 vs int8 vs int4 linear layers, bf16 vs fp8 KV.

    python -m ttsserve.bench.decode_kernels [--batches 1,64,256] [--context 512] [--json FILE]

Random weights at the real ChatTTS size (20 layers, 768 hidden): a step costs what it costs on the real
checkpoint. For each variant and batch size B: one decode step (B sequences with `context` cached frames
each, one new frame each) timed eagerly and as a replayed CUDA graph (median of CUDA-event timings), plus
the four linear layers alone (cuBLAS bf16 vs the Triton kernels, graph-replayed by triton.testing) at the
decode batch sizes and at a 2048-token prefill. Memory: GPT weight bytes and KV bytes per frame.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from types import SimpleNamespace

import torch

from ttsserve.model.cpu_linear import stored_weight_bytes

VARIANTS = (
    ("bf16", None, "auto"),
    ("int8", "int8", "auto"),
    ("int4", "awq-int4", "auto"),
    ("bf16+fp8kv", None, "fp8"),
    ("int8+fp8kv", "int8", "fp8"),
)


def build_gpts(device: torch.device) -> dict[str, torch.nn.Module]:
    from ttsserve.config import GPTConfig
    from ttsserve.layers.quant.linear import cast_except_quant, quantize_gpt_
    from ttsserve.layers.quant.quantize import QuantConfig
    from ttsserve.model.dummy import SIZES, _gpt, gpt_config_json
    from ttsserve.model.gpt import GPT

    s = SIZES["real"]
    cfg = GPTConfig.from_hf_json(gpt_config_json(s))
    sd = _gpt(torch.Generator().manual_seed(0), s)
    out = {"bf16": GPT.from_state_dict(sd, cfg, dtype=torch.bfloat16, device=device).eval()}
    for name, method in (("int8", "int8"), ("int4", "awq-int4")):
        g = quantize_gpt_(GPT.from_state_dict(sd, cfg, device=device), QuantConfig.for_method(method))
        out[name] = cast_except_quant(g, device, torch.bfloat16).eval()
    return out


def make_caches(cfg, num_blocks: int, kv_dtype: str, device: torch.device) -> list:
    """Per-layer caches filled with random data (timing on zeros can flatter the kernels)."""
    from ttsserve.attention.backend import kv_cache_shape
    from ttsserve.layers.quant.kv_fp8 import FP8KVCache

    shape = kv_cache_shape(num_blocks, 16, cfg.num_kv_heads, cfg.head_dim)
    caches = []
    for _ in range(cfg.num_layers):
        if kv_dtype == "fp8":
            c = FP8KVCache.zeros(shape, device)
            c.data.copy_(torch.randn(shape, device=device).to(c.data.dtype))
            c.scales.uniform_(0.005, 0.02)
        else:
            c = torch.randn(shape, device=device, dtype=torch.bfloat16)
        caches.append(c)
    return caches


def time_step(gpt, cfg, batch: int, context: int, kv_dtype: str, device: torch.device, iters: int) -> dict:
    from ttsserve.attention.backend import PagedAttention
    from ttsserve.attention.torch_ref import make_metadata
    from ttsserve.attention.triton_paged import TritonPagedAttention, TritonTuning, choose_num_splits

    per_seq = -(-(context + 1) // 16)
    caches = make_caches(cfg, batch * per_seq, kv_dtype, device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    md = make_metadata(tables, [context] * batch, [1] * batch, 16, device)
    splits = choose_num_splits(batch * cfg.num_kv_heads, context + 1, 132, TritonTuning())
    ctx = PagedAttention(TritonPagedAttention(num_splits=splits), caches, md, cfg.head_dim**-0.5)
    x = torch.randn(batch, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    pos = torch.full((batch,), context, device=device, dtype=torch.int64)

    def run() -> torch.Tensor:
        return gpt(x, pos, ctx)

    eager = _median_ms(run, iters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    replay = _median_ms(graph.replay, iters)
    del graph, caches
    torch.cuda.empty_cache()
    return {"eager_ms": eager, "graph_ms": replay, "splits": splits}


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_linears(gpts: dict, ms: list[int]) -> list[dict]:
    """Each of layer 0's four linears alone, per variant and M (graph-replayed: no launch gaps)."""
    import triton.testing

    rows = []
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        for m in ms:
            row = {"linear": name, "m": m}
            for variant, gpt in gpts.items():
                lin = getattr(gpt.layers[0], name)
                k = lin.in_features
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row[variant + "_us"] = 1000 * triton.testing.do_bench_cudagraph(lambda lin=lin, x=x: lin(x), rep=20)
            row["weight_MB_bf16"] = lin.in_features * lin.out_features * 2 / 1e6
            rows.append(row)
    return rows


def sweep_quant_configs(ms: list[int]) -> list[dict]:
    """Launch shapes of the Triton quant matmul (us, graph-replayed) on the real GPT's four linear shapes."""
    import triton.testing

    from ttsserve.layers.quant.quantize import QuantConfig, quantize_weight
    from ttsserve.layers.quant.triton_quant import QuantMMConfig, quant_matmul

    rows = []
    for method in ("int8", "awq-int4"):
        qc = QuantConfig.for_method(method)
        for n, k in ((2304, 768), (768, 768), (6144, 768), (768, 3072)):
            t = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, qc)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bm, bk = (16 if m <= 16 else 64), (128 if qc.bits == 8 else qc.group_size)
                cands = {
                    "auto": None,
                    "bn32": QuantMMConfig(bm, 32, bk, 1, 4, 3),
                    "bn64": QuantMMConfig(bm, 64, bk, 1, 4, 3),
                    "bn32_s2": QuantMMConfig(bm, 32, bk, 2, 4, 3),
                    "bn64_s4": QuantMMConfig(bm, 64, bk, 4, 4, 3),
                }
                row = {"method": method, "n": n, "k": k, "m": m}
                for name, cfg in cands.items():

                    def fn(x=x, t=t, cfg=cfg, qc=qc):
                        return quant_matmul(
                            x, t["qweight"], t["scales"], t.get("qzeros"), qc.bits, qc.group_size, 132, cfg
                        )

                    row[name] = 1000 * triton.testing.do_bench_cudagraph(fn, rep=10)
                rows.append(row)
    return rows


def time_attention(batch: int, context: int) -> dict:
    """One layer's decode attention kernel alone (us, graph-replayed): bf16 cache vs fp8 cache."""
    import triton.testing

    from ttsserve.attention.torch_ref import make_metadata
    from ttsserve.attention.triton_paged import TritonPagedAttention

    per_seq = -(-(context + 1) // 16)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    md = make_metadata(tables, [context] * batch, [1] * batch, 16, "cuda")
    q, k, v = (torch.randn(batch, 12, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for kv in ("auto", "fp8"):
        layer = SimpleNamespace(num_layers=1, num_kv_heads=12, head_dim=64)
        cache = make_caches(layer, batch * per_seq, kv, torch.device("cuda"))[0]
        be = TritonPagedAttention(num_splits=1)
        out[kv + "_us"] = 1000 * triton.testing.do_bench_cudagraph(
            lambda be=be, cache=cache: be.forward(q, k, v, cache, md, 0.125), rep=20
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep quant-matmul launch shapes and time the decode attention kernel alone (bf16 vs fp8 cache)",
    )
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from ttsserve.runner.kv_cache import kv_bytes_per_token

    device = torch.device("cuda")
    batches = [int(b) for b in a.batches.split(",")]
    gpts = build_gpts(device)
    cfg = gpts["bf16"].cfg
    result = {"device": torch.cuda.get_device_name(), "context": a.context, "steps": [], "memory": {}}
    with torch.inference_mode():
        for label, _method, kv in VARIANTS:
            gpt = gpts[label.split("+")[0]]
            result["memory"][label] = {
                "gpt_weight_MiB": stored_weight_bytes(gpt) / 2**20,
                "kv_KiB_per_frame": kv_bytes_per_token(cfg, torch.bfloat16, kv) / 1024,
            }
            for b in batches:
                r = time_step(gpt, cfg, b, a.context, kv, device, a.iters)
                result["steps"].append({"variant": label, "batch": b, **r})
                print(f"{label:>11} B={b:<4} eager {r['eager_ms']:.3f} ms  graph {r['graph_ms']:.3f} ms", flush=True)
        result["linears"] = time_linears(gpts, batches + [2048])
        if a.sweep:
            result["sweep"] = sweep_quant_configs(batches)
            result["attention"] = time_attention(max(batches), a.context)
    _print_tables(result, batches)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def _print_tables(result: dict, batches: list[int]) -> None:
    print(f"\n{result['device']}, context {result['context']} frames, decode step of the 20-layer GPT (ms):")
    print(
        f"{'variant':>11} "
        + " ".join(f"{'B=' + str(b) + ' eager':>12} {'graph':>8}" for b in batches)
        + f" {'weights MiB':>12} {'KV KiB/frame':>13}"
    )
    for label, _, _ in VARIANTS:
        steps = {s["batch"]: s for s in result["steps"] if s["variant"] == label}
        mem = result["memory"][label]
        print(
            f"{label:>11} "
            + " ".join(f"{steps[b]['eager_ms']:>12.3f} {steps[b]['graph_ms']:>8.3f}" for b in batches)
            + f" {mem['gpt_weight_MiB']:>12.1f} {mem['kv_KiB_per_frame']:>13.1f}"
        )
    print("\nlayer-0 linears alone (us, CUDA-graph replay):")
    print(f"{'linear':>13} {'M':>5} {'bf16':>8} {'int8':>8} {'int4':>8}")
    for r in result["linears"]:
        print(f"{r['linear']:>13} {r['m']:>5} {r['bf16_us']:>8.1f} {r['int8_us']:>8.1f} {r['int4_us']:>8.1f}")
    if "sweep" in result:
        names = ("auto", "bn32", "bn64", "bn32_s2", "bn64_s4")
        print(
            "\nquant matmul launch shapes (us):\n"
            + f"{'method':>8} {'N':>5} {'K':>5} {'M':>4} "
            + " ".join(f"{n:>8}" for n in names)
        )
        for r in result["sweep"]:
            print(f"{r['method']:>8} {r['n']:>5} {r['k']:>5} {r['m']:>4} " + " ".join(f"{r[n]:>8.1f}" for n in names))
        att = result["attention"]
        print(
            f"\ndecode attention, one layer, B={max(batches)}, context {result['context']}: "
            f"bf16 cache {att['auto_us']:.1f} us, fp8 cache {att['fp8_us']:.1f} us"
        )


if __name__ == "__main__":
    sys.exit(main())
