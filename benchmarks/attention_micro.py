"""Decode-attention micro-benchmark: TritonPagedAttention vs torch SDPA on dense tensors (CUDA only).

For each batch size and context length, 20 layers' worth of decode attention (one new token per sequence,
12 heads x 64, bf16, block_size 16; a separate KV cache per layer, as in the model, so the timing is not
an L2-cache effect) is timed two ways: eager launches (triton.testing.do_bench, median) and one CUDA
graph of the 20 layers (median replay time over CUDA events). Achieved bandwidth counts the bytes that
must move: every cached K and V read once, plus q, the new k / v and the output.

    python3 benchmarks/attention_micro.py [--sweep] [--json PATH]

--sweep also times decode tile sizes and warp counts of the Triton kernel at a few shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 12, 64, 20, 16
PEAK_TBPS = 4.3  # device-to-device copy measured on an H200 of this workplace (bytes read + written)
SHAPES = [(1, 300), (1, 1500), (64, 300), (64, 1500), (256, 300), (256, 1500)]


def graph_time_ms(fn, replays: int = 50) -> float:
    """Median time of one replay of a CUDA graph that runs `fn` once (fn warmed up first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
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


def paged_setup(batch: int, ctx: int, gen: torch.Generator):
    """Per-layer caches, one random block table shared by the layers (as in the engine), decode metadata."""
    from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape

    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32).cuda()
    shape = kv_cache_shape(num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    caches = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    slot_mapping = block_tables[:, -1].long() * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE  # the new token's slot
    md = AttentionMetadata(
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        block_tables=block_tables, slot_mapping=slot_mapping, max_query_len=1, max_seq_len=ctx,
        block_size=BLOCK_SIZE, cu_seqlens_q_cpu=list(range(batch + 1)), seq_lens_cpu=[ctx] * batch)
    qkv = torch.randn(batch, 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return caches, md, qkv[:, 0], qkv[:, 1], qkv[:, 2]


def bench_triton(batch: int, ctx: int, gen: torch.Generator, **backend_kw) -> tuple[float, float]:
    from ttsserve.attention.triton_paged import TritonPagedAttention

    caches, md, q, k, v = paged_setup(batch, ctx, gen)
    backend = TritonPagedAttention(**backend_kw)
    scale = HEAD_DIM ** -0.5

    def step() -> None:
        for cache in caches:
            backend.forward(q, k, v, cache, md, scale)

    result = eager_time_ms(step), graph_time_ms(step)
    del caches
    torch.cuda.empty_cache()
    return result


def bench_sdpa(batch: int, ctx: int) -> tuple[float, float]:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kvs = [torch.randn(2, batch, HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

    def step() -> None:
        for kv in kvs:
            F.scaled_dot_product_attention(q, kv[0], kv[1])

    result = eager_time_ms(step), graph_time_ms(step)
    del kvs
    torch.cuda.empty_cache()
    return result


def bench_prefill(num_seqs: int, q_len: int) -> tuple[float, float]:
    """Fresh prompts of q_len tokens each, 20 layers, eager: Triton paged vs dense causal SDPA (ms)."""
    from ttsserve.attention.backend import AttentionMetadata, kv_cache_shape
    from ttsserve.attention.triton_paged import TritonPagedAttention

    blocks = math.ceil(q_len / BLOCK_SIZE)
    block_tables = torch.randperm(num_seqs * blocks).view(num_seqs, blocks).to(torch.int32).cuda()
    pos = torch.arange(q_len, device="cuda")
    slot_mapping = (block_tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).flatten()
    cu = [i * q_len for i in range(num_seqs + 1)]
    md = AttentionMetadata(torch.tensor(cu, dtype=torch.int32, device="cuda"),
                           torch.full((num_seqs,), q_len, dtype=torch.int32, device="cuda"), block_tables,
                           slot_mapping, q_len, q_len, BLOCK_SIZE, cu, [q_len] * num_seqs)
    shape = kv_cache_shape(num_seqs * blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    caches = [torch.empty(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    qkv = torch.randn(num_seqs * q_len, 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    backend, scale = TritonPagedAttention(), HEAD_DIM ** -0.5
    dense = qkv.view(num_seqs, q_len, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).contiguous()

    def paged() -> None:
        for cache in caches:
            backend.forward(qkv[:, 0], qkv[:, 1], qkv[:, 2], cache, md, scale)

    def sdpa() -> None:
        for _ in range(LAYERS):
            F.scaled_dot_product_attention(dense[0], dense[1], dense[2], is_causal=True)

    return eager_time_ms(paged), eager_time_ms(sdpa)


def layer_bytes(batch: int, ctx: int) -> int:
    kv_read = batch * ctx * HEADS * HEAD_DIM * 2 * 2  # K and V, bf16
    return kv_read + 4 * batch * HEADS * HEAD_DIM * 2  # q, new k, new v, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time decode tile sizes / warp counts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    print(f"decode attention, {LAYERS} layers, bf16, {HEADS}x{HEAD_DIM} heads, block_size {BLOCK_SIZE}; "
          f"bandwidth vs {PEAK_TBPS} TB/s")
    print(f"{'batch':>5} {'ctx':>5} | {'triton eager':>12} {'graph':>8} {'TB/s':>5} {'%peak':>5} | "
          f"{'sdpa eager':>10} {'graph':>8} {'TB/s':>5}   (ms per 20 layers)")
    for batch, ctx in SHAPES:
        t_eager, t_graph = bench_triton(batch, ctx, gen)
        s_eager, s_graph = bench_sdpa(batch, ctx)
        nbytes = layer_bytes(batch, ctx) * LAYERS
        tbps, sdpa_tbps = nbytes / t_graph / 1e9, nbytes / s_graph / 1e9
        rows.append(dict(batch=batch, ctx=ctx, triton_eager_ms=t_eager, triton_graph_ms=t_graph,
                         sdpa_eager_ms=s_eager, sdpa_graph_ms=s_graph, bytes=nbytes, triton_tbps=tbps))
        print(f"{batch:>5} {ctx:>5} | {t_eager:>12.3f} {t_graph:>8.3f} {tbps:>5.2f} {100 * tbps / PEAK_TBPS:>5.1f} | "
              f"{s_eager:>10.3f} {s_graph:>8.3f} {sdpa_tbps:>5.2f}")
    for num_seqs, q_len in [(1, 300), (16, 300)]:
        t, s = bench_prefill(num_seqs, q_len)
        rows.append(dict(prefill_seqs=num_seqs, q_len=q_len, triton_eager_ms=t, sdpa_eager_ms=s))
        print(f"prefill {num_seqs} x {q_len} tokens, {LAYERS} layers eager: triton {t:.3f} ms, "
              f"dense causal sdpa {s:.3f} ms")
    if args.sweep:
        print("sweep (graph ms per 20 layers): block_n x num_warps")
        for batch, ctx in [(1, 1500), (64, 1500), (256, 1500)]:
            for block_n in (32, 64, 128):
                cells = []
                for warps in (2, 4, 8):
                    _, t = bench_triton(batch, ctx, gen, decode_block_n=block_n, decode_num_warps=warps)
                    cells.append(f"w{warps}={t:.3f}")
                    rows.append(dict(batch=batch, ctx=ctx, block_n=block_n, warps=warps, triton_graph_ms=t))
                print(f"  B={batch:<4} ctx={ctx:<5} block_n={block_n:<4} " + " ".join(cells))
        print("sweep (graph ms per 20 layers): num_splits")
        for batch, ctx in [(1, 300), (1, 1500), (8, 1500), (64, 1500)]:
            cells = []
            for splits in (1, 2, 4, 8, 16, 32):
                _, t = bench_triton(batch, ctx, gen, num_splits=splits)
                cells.append(f"s{splits}={t:.3f}")
                rows.append(dict(batch=batch, ctx=ctx, num_splits=splits, triton_graph_ms=t))
            print(f"  B={batch:<4} ctx={ctx:<5} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
