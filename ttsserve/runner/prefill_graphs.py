"""CUDA graphs of the GPT forward for prefill steps, by token bucket (vLLM V1's full and piecewise modes).

A prefill (or chunked prefill, recompute, refine-text) step has a different shape every time, so the decode
graphs cannot serve it, and run op by op it costs the host ~30 launches per layer: on an H200 an engine
step that also prefilled took several decode steps of host time. The forward is cut at attention into pieces:
piece 0 is the first layer's norm, q/k/v projection and RoPE; piece i (1..L-1) is layer i-1's output
projection and MLP plus layer i's norm, q/k/v and RoPE; piece L is the last layer's output half and the
final norm. Sizes are padded up to the bucket. The pieces read and write static buffers (the bucket's first
rows): x and positions in, q / k / v and the residual between pieces, the attention output back in, the hidden
states out. Padding rows hold stale finite values; they are never attended to (the attention only sees the
step's real tokens) and their rows are dropped.

Full graphs (the default on CUDA with the Triton backend): one graph per bucket holds the pieces and the paged
attention between them. The attention reads static metadata (cu_seqlens_q, seq_lens, block tables, slots;
padding rows' slots -1, so nothing is written for them) and runs over a table of query tiles
(attention/prefill_tiles.py) sized for the bucket, all of which run() fills before each replay; its BLOCK_M is
the bucket's (prefill_block_m of the bucket size). Piecewise graphs (TTSSERVE_PREFILL_GRAPHS=piecewise, or
another attention backend): each piece is a graph of its own and the attention runs eagerly between the
replays, L attention calls and L + 1 replays, which cost the host ~40 Triton launches a step (the KV write
and the kernel per layer; ~9 % of the engine core's samples served at 512 streams on an H100 whose host was
the wall). Off CUDA nothing is captured: run() calls the same pieces eagerly on the same buffers, which is
what the CPU tests check against GPT.forward; given full=True it runs the full path so, the static metadata and
the tile table read by the reference backend's prefill_tiled (attention/torch_ref.py).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from ttsserve.attention.backend import AttentionMetadata
from ttsserve.attention.prefill_tiles import max_prefill_tiles, prefill_block_m, prefill_tiles
from ttsserve.h2d import async_h2d
from ttsserve.runner.cuda_graphs import capture_graph, or_uncompiled
from ttsserve.runner.decode_ops import DecodeOps
from ttsserve.runner.graph_buckets import BucketedGraphs

logger = logging.getLogger(__name__)


def default_prefill_sizes(max_tokens: int) -> list[int]:
    """Token buckets 16, 32, then 64, 96, 128, 192, 256, ... (powers of two and 1.5x between them), up to and
    including max_tokens: at most a third of a replay is padding."""
    sizes, p = [16, 32], 64
    while p < max_tokens:
        sizes += [p, p * 3 // 2]
        p *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def prefill_graph_mode() -> str:
    """$TTSSERVE_PREFILL_GRAPHS: full (the default) or piecewise; anything else is an error naming the variable."""
    mode = os.environ.get("TTSSERVE_PREFILL_GRAPHS", "full")
    if mode not in ("full", "piecewise"):
        raise ValueError(f"TTSSERVE_PREFILL_GRAPHS must be full or piecewise, got {mode!r}")
    return mode


class PrefillGraphs(BucketedGraphs):
    """Bucketed piecewise graphs of one ModelRunner's GPT (`capture()` before `run()`; with defer=True,
    `capture_next()` captures the other buckets later, largest first: a step's tokens replay the smallest
    captured bucket that holds them)."""

    def __init__(
        self, runner, sizes: list[int], ops: DecodeOps, max_seqs: int | None = None, full: bool | None = None
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"prefill graph sizes must be positive, got {sizes}")
        self.runner, self.ops = runner, ops
        self.gpt = runner.model.gpt
        cfg, dev, dt = self.gpt.cfg, runner.device, self.gpt.dtype
        self._init_buckets(sizes)
        n = self.sizes[-1]
        self.num_layers = cfg.num_layers
        self.x = torch.zeros(n, cfg.hidden_size, dtype=dt, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.q = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dt, device=dev)
        self.k = torch.zeros(n, cfg.num_kv_heads, cfg.head_dim, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)
        self.residual = torch.zeros_like(self.x)
        self.cos = torch.zeros(n, 1, cfg.head_dim, dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.out = torch.zeros_like(self.x)
        self.capture_s = 0.0
        mode = prefill_graph_mode()  # checked on every device: a typo is an error, not a silent default
        if full is None:
            full = dev.type == "cuda" and runner.backend.name == "triton" and mode == "full"
        self.full = full  # given True off CUDA: the same path run eagerly (the CPU tests of its metadata)
        if self.full:
            self._init_metadata(n, min(n, max_seqs or n), runner.input_batch.block_table.shape[1])

    def _init_metadata(self, n: int, max_seqs: int, max_blocks: int) -> None:
        """The full graphs' static attention metadata, for at most n tokens of at most max_seqs sequences."""
        dev = self.runner.device
        pinned = getattr(getattr(self.runner.backend, "tuning", None), "prefill_block_m", None)  # Triton's tuning
        self.max_seqs = max_seqs
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.cu = torch.zeros(max_seqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=dev)
        self.block_m = {b: pinned or prefill_block_m(b) for b in self.sizes}
        self.num_tiles = {b: max_prefill_tiles(b, max_seqs, self.block_m[b]) for b in self.sizes}
        self.tiles = torch.full((max(self.num_tiles.values()), 2), -1, dtype=torch.int32, device=dev)

    def can_run(self, num_tokens: int, num_seqs: int = 1) -> bool:
        return num_tokens <= self.sizes[-1] and (not self.full or num_seqs <= self.max_seqs)

    # ---- the pieces --------------------------------------------------------------------------------------
    def _qkv(self, layer, normed: torch.Tensor, t: int) -> None:
        cfg = self.gpt.cfg
        q, k, v = self.ops.qkv_rotary(
            layer.qkv_proj(normed), self.cos[:t], self.sin[:t], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )
        self.q[:t].copy_(q)
        self.k[:t].copy_(k)
        self.v[:t].copy_(v)

    def _piece(self, i: int, t: int) -> None:
        """Piece i of the forward over the first t rows of the static buffers."""
        gpt, ops = self.gpt, self.ops
        if i == 0:
            cos, sin = gpt.rotary(self.positions[:t], self.x.dtype)
            self.cos[:t].copy_(cos)
            self.sin[:t].copy_(sin)
            layer = gpt.layers[0]
            self.residual[:t].copy_(self.x[:t])
            self._qkv(layer, ops.rmsnorm(self.x[:t], layer.input_layernorm.weight, layer.input_layernorm.eps), t)
            return
        layer = gpt.layers[i - 1]
        norm = layer.post_attention_layernorm
        normed, residual = ops.add_rmsnorm(
            layer.o_proj(self.attn[:t].reshape(t, -1)), self.residual[:t], norm.weight, norm.eps
        )
        h = layer.down_proj(ops.silu_mul(layer.gate_up_proj(normed)))
        if i == self.num_layers:
            self.out[:t].copy_(ops.add_rmsnorm(h, residual, gpt.norm.weight, gpt.norm.eps)[0])
            return
        nxt = gpt.layers[i]
        normed, residual = ops.add_rmsnorm(h, residual, nxt.input_layernorm.weight, nxt.input_layernorm.eps)
        self.residual[:t].copy_(residual)
        self._qkv(nxt, normed, t)

    def _or_uncompiled(self, fn, what: str) -> None:
        or_uncompiled(self, fn, what)

    # ---- capture / replay --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, defer: bool = False) -> None:
        """Warm and capture every bucket, largest first, into one memory pool (defer: the
        largest and smallest buckets only; capture_next() takes the rest). If the torch.compile'd ops fail at
        these shapes, capture again with the same ops uncompiled (slower pieces, never wrong), as the decode
        graphs do."""
        fn = self._capture_first if defer else self._capture_all
        or_uncompiled(self, fn, "capturing the prefill graphs with compiled ops")

    def _capture_all(self) -> None:
        self._capture_sizes(self._reset_buckets(defer=False))

    def _capture_first(self) -> None:
        self._capture_sizes(self._reset_buckets(defer=True))

    def _capture_sizes(self, sizes: list[int]) -> None:
        t0 = time.perf_counter()
        if self.full and self.pending and self.runner.device.type == "cuda":  # the deferred buckets' variants
            self._precompile_attention()
        for t in sizes:
            self._capture_bucket(t)
        self.capture_s = time.perf_counter() - t0
        if self.runner.device.type == "cuda":
            logger.info(
                "captured %d %s prefill CUDA graphs (%d token buckets, %d..%d) in %.1f s%s",
                len(sizes) * (1 if self.full else self.num_layers + 1),
                "full" if self.full else "piecewise",
                len(sizes),
                sizes[-1],
                sizes[0],
                self.capture_s,
                f"; {len(self.pending)} more buckets after start-up, between steps" if self.pending else "",
            )

    @torch.inference_mode()
    def _capture_bucket(self, t: int) -> None:
        """Warm at t tokens (compiles the ops, lets cuBLAS pick its kernels), capture the forward (full) or each
        piece, then replay once: a graph's first launch uploads it, which belongs here, not in a live step."""
        if self.runner.device.type != "cuda":
            self._add_graph(t, None if self.full else [None] * (self.num_layers + 1))
            return
        torch.cuda.synchronize()  # a step in flight may still read the static buffers the pieces write
        if self.full:
            self._capture_full(t)
            return
        for i in range(self.num_layers + 1):
            self._piece(i, t)
        graphs = []
        for i in range(self.num_layers + 1):
            g, self.pool = capture_graph(lambda: self._piece(i, t), self.pool)
            graphs.append(g)
        for g in graphs:
            g.replay()
        torch.cuda.synchronize()
        self._add_graph(t, graphs)

    # ---- full graphs: the attention captured with the pieces ------------------------------------------------
    def _attend_tiled(self, layer_idx: int, t: int, num_tiles: int, block_m: int) -> None:
        """Layer layer_idx's attention of the first t rows into self.attn, over the first num_tiles tiles."""
        r = self.runner
        md = AttentionMetadata(self.cu, self.seq_lens, self.tables, self.slots[:t], t, 0, r.block_size, [], [])
        r.backend.prefill_tiled(
            self.attn[:t], self.q[:t], self.k[:t], self.v[:t], r.kv.layers[layer_idx], md, r.scale,
            self.tiles[:num_tiles], block_m,
        )  # fmt: skip

    def _forward_full(self, t: int) -> None:
        """The whole forward over the bucket's t rows, the attention through the static metadata and tiles."""
        for i in range(self.num_layers + 1):
            if i:
                self._attend_tiled(i - 1, t, self.num_tiles[t], self.block_m[t])
            self._piece(i, t)

    def _capture_full(self, t: int) -> None:
        """Warm at t tokens with every tile and slot unused (the attention writes and reads nothing: a queued step
        was waited for, and the metadata is refilled before each replay), capture, upload."""
        self.tiles.fill_(-1)
        self.slots.fill_(-1)
        self._forward_full(t)
        graph, self.pool = capture_graph(lambda: self._forward_full(t), self.pool)
        graph.replay()
        torch.cuda.synchronize()
        self._add_graph(t, graph)

    @torch.inference_mode()
    def _precompile_attention(self) -> None:
        """Launch the tiled attention once at each bucket's BLOCK_M with every tile unused: a bucket captured
        between served steps would otherwise compile its variant there (0.4-1.9 s on an empty Triton cache)."""
        torch.cuda.synchronize()  # a step in flight may still read the tiles and slots
        self.tiles.fill_(-1)
        self.slots.fill_(-1)
        for block_m in sorted(set(self.block_m.values())):
            self._attend_tiled(0, min(b for b in self.sizes if self.block_m[b] == block_m), 1, block_m)

    def _load_metadata(self, md: AttentionMetadata, t: int, b: int) -> None:
        """The step's attention metadata into the static buffers the bucket b's graph reads (t real tokens)."""
        n = md.num_seqs
        self.cu[: n + 1].copy_(md.cu_seqlens_q)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.tables[:n].copy_(md.block_tables)
        self.slots[:t].copy_(md.slot_mapping)
        self.slots[t:b].fill_(-1)
        tiles = prefill_tiles(np.diff(md.cu_seqlens_q_cpu), self.block_m[b], self.num_tiles[b])
        self.tiles[: len(tiles)].copy_(async_h2d(torch.from_numpy(tiles), self.runner.device))

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """GPT forward of x [T, H] at positions [T] with attention context ctx (a PagedAttention) -> hidden
        [T, H] in the GPT dtype: a view of the static output, valid until the next run()."""
        t = x.shape[0]
        b = self.bucket(t)
        self.x[:t].copy_(x)
        self.positions[:t].copy_(positions)
        graphs = self.graphs[b]
        if self.full:
            self._load_metadata(ctx.md, t, b)
            if graphs is None:
                self._forward_full(b)
            else:
                graphs.replay()
            return self.out[:t]
        for i in range(self.num_layers + 1):
            if i:
                self.attn[:t].copy_(ctx.attend(i - 1, self.q[:t], self.k[:t], self.v[:t]))
            if graphs[i] is None:
                self._piece(i, b)
            else:
                graphs[i].replay()
        return self.out[:t]
