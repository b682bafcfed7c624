"""Decode-attention micro-benchmark: TritonPagedAttention vs torch SDPA on dense tensors (CUDA only).

For each batch size and context length, 20 layers' worth of decode attention (one new token per sequence,
12 heads x 64, bf16, block_size 16; a separate KV cache per layer, as in the model, so the timing is not
an L2-cache effect) is timed two ways: eager launches (triton.testing.do_bench, median) and one CUDA
graph of the 20 layers (median replay time over CUDA events). The Triton forward includes the KV-cache
write of the new token; SDPA does not write anything. Achieved bandwidth counts the bytes that must move:
every cached K and V read once, plus q, the new k / v (read and written) and the output.

    python3 benchmarks/attention_micro.py [--sweep] [--kv [--kv-shapes 512x32,512x300]] [--kv-prefill] [--json PATH]

--sweep also times decode kernels / tile sizes / warps / split counts, and prefill tile shapes.
--kv-prefill times only the prefill kernel on a bf16 and an fp8 cache (fresh prompts, a later chunk).
--kv times only the decode kernel, on a bf16 cache and on an fp8 one (`--kv-cache-dtype fp8`), through its
tensor-core dots and its CUDA-core lanes (TritonTuning.decode_lanes) at a few tiles, warps and (lanes) loop
pipeline depths and KV heads a program, each at the bytes it must read (fp8: 1 byte a value plus one fp32 scale per 64).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape  # noqa: E402

HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 12, 64, 20, 16
PEAK_TBPS = 4.3  # device-to-device copy measured on an H200 of this workplace (bytes read + written)
SHAPES = [(1, 300), (1, 1500), (8, 1500), (64, 300), (64, 1500), (256, 300), (256, 1500)]
KV_SHAPES = [(64, 300), (256, 300), (512, 300)]
DOT_TILES = [(64, 4), (32, 4)]  # (BLOCK_N, warps)
# (lanes a tile: tokens x heads, warps, loop stages, KV heads a program); stages None: the loop not pipelined
# (tl.range's num_stages); heads None: as TritonTuning.lanes_heads picks for the batch
LANE_TILES = [
    (32, 4, None, 1),
    (32, 4, 3, 1),
    (32, 4, 3, 2),
    (32, 4, None, 4),
    (32, 4, 3, 4),
    (32, 4, 4, 4),
    (16, 4, 3, 4),
    (32, 4, 3, None),
]


def graph_time_ms(fn, replays: int = 30) -> float:
    """Median time of one replay of a CUDA graph that runs `fn` once (fn warmed up first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def eager_time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def make_md(q_lens: list[int], seq_lens: list[int], gen: torch.Generator) -> AttentionMetadata:
    """Random pages for each sequence; slots for its last q_len positions."""
    blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 1, generator=gen)
    block_tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32)
    slots, taken = [], 0
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        block_tables[b, : blocks[b]] = perm[taken : taken + blocks[b]]
        taken += blocks[b]
        pos = torch.arange(s - n, s)
        slots.append(block_tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=block_tables.cuda(),
        slot_mapping=torch.cat(slots).cuda(),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=list(seq_lens),
    )


class PagedSetup:
    """20 layers' caches (random contents), one block table shared by the layers as in the engine."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], gen: torch.Generator, kv: str = "auto") -> None:
        self.md = make_md(q_lens, seq_lens, gen)
        num_blocks = int(self.md.block_tables.max()) + 1
        shape = kv_cache_shape(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
        self.caches = [make_cache(shape, kv) for _ in range(LAYERS)]
        qkv = torch.randn(sum(q_lens), 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.q, self.k, self.v = qkv[:, 0], qkv[:, 1], qkv[:, 2]

    def step_fn(self, backend):
        def step() -> None:
            for cache in self.caches:
                backend.forward(self.q, self.k, self.v, cache, self.md, HEAD_DIM**-0.5)

        return step


def make_cache(shape: tuple[int, ...], kv: str):
    """One layer's cache of random contents: bf16, or fp8 values with scales of served magnitude."""
    if kv == "auto":
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    from ttsserve.layers.quant.kv_fp8 import FP8KVCache

    cache = FP8KVCache.zeros(shape, "cuda")
    cache.data.copy_((torch.randn(shape, device="cuda") * 100).clamp_(-448, 448).to(cache.data.dtype))
    cache.scales.uniform_(0.005, 0.02)
    return cache


def bench_sdpa(batch: int, ctx: int) -> tuple[float, float]:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kvs = [torch.randn(2, batch, HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

    def step() -> None:
        for kv in kvs:  # noqa: F821 (ruff misreads the del below)
            F.scaled_dot_product_attention(q, kv[0], kv[1])

    result = eager_time_ms(step), graph_time_ms(step)
    del kvs
    torch.cuda.empty_cache()
    return result


def layer_bytes(batch: int, ctx: int) -> int:
    kv_read = batch * ctx * HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    return kv_read + 6 * batch * HEADS * HEAD_DIM * 2  # q, new k / v read and written, out


def decode_table(gen: torch.Generator, rows: list[dict]) -> None:
    from ttsserve.attention.triton_paged import TritonPagedAttention

    print(
        f"{'batch':>5} {'ctx':>5} | {'triton eager':>12} {'graph':>7} {'TB/s':>5} {'%peak':>5} | "
        f"{'sdpa eager':>10} {'graph':>7} {'TB/s':>5}   (ms per {LAYERS} layers)"
    )
    for batch, ctx in SHAPES:
        setup = PagedSetup([1] * batch, [ctx] * batch, gen)
        step = setup.step_fn(TritonPagedAttention())
        t_eager, t_graph = eager_time_ms(step), graph_time_ms(step)
        del setup
        torch.cuda.empty_cache()
        s_eager, s_graph = bench_sdpa(batch, ctx)
        nbytes = layer_bytes(batch, ctx) * LAYERS
        tbps, sdpa_tbps = nbytes / t_graph / 1e9, nbytes / s_graph / 1e9
        rows.append(
            dict(
                batch=batch,
                ctx=ctx,
                triton_eager_ms=t_eager,
                triton_graph_ms=t_graph,
                sdpa_eager_ms=s_eager,
                sdpa_graph_ms=s_graph,
                bytes=nbytes,
                triton_tbps=tbps,
            )
        )
        print(
            f"{batch:>5} {ctx:>5} | {t_eager:>12.3f} {t_graph:>7.3f} {tbps:>5.2f} {100 * tbps / PEAK_TBPS:>5.1f} | "
            f"{s_eager:>10.3f} {s_graph:>7.3f} {sdpa_tbps:>5.2f}"
        )


def kv_table(gen: torch.Generator, rows: list[dict], shapes: list[tuple[int, int]]) -> None:
    """The decode kernel (default splits, 20 layers, one graph) on a bf16 cache and on an fp8 one, as tensor-core
    dots at each (BLOCK_N, warps) of DOT_TILES and as the one-row CUDA-core lanes at each (BLOCK_N, warps, loop
    stages) of LANE_TILES."""
    from ttsserve.attention.triton_paged import TritonPagedAttention, TritonTuning

    print(
        f"decode (graph ms per {LAYERS} layers; TB/s of the bytes each must read), "
        "n<dots: tokens | lanes: lanes a tile>/w<warps>/s<stages>[/h<lanes: KV heads a program>]:"
    )
    for batch, ctx in shapes:
        for kv in ("auto", "fp8"):
            setup = PagedSetup([1] * batch, [ctx] * batch, gen, kv)
            nbytes = (HEADS * (HEAD_DIM + 4) * 2 if kv == "fp8" else HEADS * HEAD_DIM * 4) * batch * ctx * LAYERS
            ref = None
            for lanes in (False, True):
                path = "all" if lanes else "none"
                be = TritonPagedAttention(tuning=TritonTuning(decode_lanes=path))
                out = be.forward(setup.q, setup.k, setup.v, setup.caches[0], setup.md, 0.125).float()
                ref = out if ref is None else ref
                diff = float((out - ref).abs().max() / ref.abs().max())
                cells = []
                for bn, w, st, heads in LANE_TILES if lanes else [(bn, w, None, 1) for bn, w in DOT_TILES]:
                    tuning = TritonTuning(
                        bn,
                        w,
                        decode_lanes=path,
                        decode_lanes_rows=bn,
                        decode_lanes_num_warps=w,
                        decode_lanes_num_stages=st,
                        decode_lanes_heads=heads or TritonTuning.decode_lanes_heads,
                        decode_lanes_programs_per_sm=TritonTuning.decode_lanes_programs_per_sm if heads is None else 0,
                    )
                    ms = graph_time_ms(setup.step_fn(TritonPagedAttention(tuning=tuning)))
                    row = dict(batch=batch, ctx=ctx, kv=kv, lanes=lanes, block_n=bn, warps=w, stages=st, graph_ms=ms)
                    rows.append(dict(row, heads=heads) if lanes else row)
                    label = f"n{bn}/w{w}/s{st or '-'}" + (f"/h{heads or 'auto'}" if lanes else "")
                    cells.append(f"{label} {ms:.3f} ({nbytes / ms / 1e9:.2f})")
                name = "lanes" if lanes else "dots"
                print(f"  B={batch:<4} ctx={ctx:<4} {kv:>4} {name:>5} (diff {diff:.0e}): " + "  ".join(cells))
            del setup
            torch.cuda.empty_cache()


def kv_prefill_table(gen: torch.Generator, rows: list[dict]) -> None:
    """The prefill kernel (20 layers, one graph) on a bf16 cache and on an fp8 one: fresh prompts (a served step's
    admissions) and a later chunk of long prompts; the fp8 time includes the stand-alone write of the new rows."""
    from ttsserve.attention.triton_paged import TritonPagedAttention

    print(f"prefill (graph ms per {LAYERS} layers), bf16 cache / fp8 cache:")
    for num_seqs, q_len, ctx in [(8, 60, 0), (8, 200, 0), (4, 256, 512)]:
        cells = []
        for kv in ("auto", "fp8"):
            setup = PagedSetup([q_len] * num_seqs, [ctx + q_len] * num_seqs, gen, kv)
            ms = graph_time_ms(setup.step_fn(TritonPagedAttention()))
            rows.append(dict(prefill_seqs=num_seqs, q_len=q_len, ctx=ctx, kv=kv, graph_ms=ms))
            cells.append(f"{kv} {ms:.3f}")
            del setup
            torch.cuda.empty_cache()
        print(f"  {num_seqs} x {q_len} new after {ctx} cached: " + "  ".join(cells))


def prefill_table(gen: torch.Generator, rows: list[dict]) -> None:
    """Fresh prompts and a later chunk of long prompts, 20 layers: Triton (incl. KV write) vs dense SDPA."""
    from ttsserve.attention.triton_paged import TritonPagedAttention

    for num_seqs, q_len, ctx in [(1, 300, 0), (16, 300, 0), (4, 512, 1024)]:
        setup = PagedSetup([q_len] * num_seqs, [ctx + q_len] * num_seqs, gen)
        step = setup.step_fn(TritonPagedAttention())
        t_eager, t_graph = eager_time_ms(step), graph_time_ms(step)
        del setup
        q = torch.randn(num_seqs, HEADS, q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(2, num_seqs, HEADS, ctx + q_len, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        # the chunk's queries are the last q_len positions: a bottom-right causal mask
        mask = torch.ones(q_len, ctx + q_len, dtype=torch.bool, device="cuda").tril(ctx)

        def sdpa() -> None:
            for _ in range(LAYERS):
                F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask if ctx else None, is_causal=not ctx)

        s_graph = graph_time_ms(sdpa)
        rows.append(
            dict(
                prefill_seqs=num_seqs,
                q_len=q_len,
                ctx=ctx,
                triton_eager_ms=t_eager,
                triton_graph_ms=t_graph,
                sdpa_graph_ms=s_graph,
            )
        )
        print(
            f"prefill {num_seqs:>2} x {q_len} new after {ctx:>4} cached: triton eager {t_eager:.3f} "
            f"graph {t_graph:.3f} ms | dense sdpa graph {s_graph:.3f} ms"
        )


def sweep(gen: torch.Generator, rows: list[dict]) -> None:
    from ttsserve.attention.triton_paged import TritonPagedAttention, TritonTuning

    variants = [TritonTuning(bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]
    print("sweep, decode (graph ms per 20 layers), default split heuristic:")
    for batch, ctx in SHAPES:
        setup = PagedSetup([1] * batch, [ctx] * batch, gen)
        cells = []
        for t in variants:
            ms = graph_time_ms(setup.step_fn(TritonPagedAttention(tuning=t)))
            rows.append(dict(batch=batch, ctx=ctx, graph_ms=ms, **asdict(t)))
            cells.append(f"n{t.decode_block_n}/w{t.decode_num_warps}/s{t.decode_num_stages}={ms:.3f}")
        print(f"  B={batch:<4} ctx={ctx:<5} " + " ".join(cells))
        if batch <= 64:
            cells = []
            for splits in (1, 2, 4, 8, 16, 32):
                ms = graph_time_ms(setup.step_fn(TritonPagedAttention(splits)))
                rows.append(dict(batch=batch, ctx=ctx, graph_ms=ms, num_splits=splits))
                cells.append(f"s{splits}={ms:.3f}")
            print(f"  B={batch:<4} ctx={ctx:<5} splits: " + " ".join(cells))
        del setup
        torch.cuda.empty_cache()
    print("sweep, prefill 16 x 300 fresh and 4 x 512 after 1024 cached (graph ms per 20 layers):")
    base = TritonTuning()
    for num_seqs, q_len, ctx in [(16, 300, 0), (4, 512, 1024)]:
        setup = PagedSetup([q_len] * num_seqs, [ctx + q_len] * num_seqs, gen)
        cells = []
        for bm in (64, 128):
            for bn in (32, 64):
                for w in (4, 8):
                    for st in (2, 3):
                        t = replace(
                            base, prefill_block_m=bm, prefill_block_n=bn, prefill_num_warps=w, prefill_num_stages=st
                        )
                        ms = graph_time_ms(setup.step_fn(TritonPagedAttention(tuning=t)))
                        rows.append(dict(prefill_seqs=num_seqs, q_len=q_len, ctx=ctx, graph_ms=ms, **asdict(t)))
                        cells.append(f"m{bm}/n{bn}/w{w}/s{st}={ms:.3f}")
        print(f"  {num_seqs}x{q_len}+{ctx}: " + " ".join(cells))
        del setup


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'512x32,512x300' -> [(512, 32), (512, 300)] (rows x context frames, both >= 1)."""
    try:
        shapes = [(int(r), int(c)) for r, c in (p.split("x") for p in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCONTEXT[,ROWSxCONTEXT...], got {text!r}") from None
    if any(r < 1 or c < 1 for r, c in shapes):
        raise argparse.ArgumentTypeError(f"rows and context must be >= 1, got {text!r}")
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time kernel variants")
    parser.add_argument("--kv", action="store_true", help="only the decode kernel: bf16 / fp8 cache, dots / lanes")
    parser.add_argument(
        "--kv-shapes",
        type=parse_shapes,
        default=KV_SHAPES,
        help="--kv's rows x context points, e.g. 512x32,512x300 (a short context shows a program's fixed cost)",
    )
    parser.add_argument("--kv-prefill", action="store_true", help="only the prefill kernel: bf16 / fp8 cache")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows: list[dict] = []
    print(
        f"decode attention, {LAYERS} layers, bf16, {HEADS}x{HEAD_DIM} heads, block_size {BLOCK_SIZE}, "
        f"{torch.cuda.get_device_name()}; bandwidth vs {PEAK_TBPS} TB/s"
    )
    if args.kv_prefill:
        kv_prefill_table(gen, rows)
    elif not args.kv:
        decode_table(gen, rows)
        prefill_table(gen, rows)
    else:
        kv_table(gen, rows, args.kv_shapes)
    if args.sweep:
        sweep(gen, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
