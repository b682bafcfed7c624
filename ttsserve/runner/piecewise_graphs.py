"""Piecewise CUDA graphs of the GPT forward for prefill steps (vLLM V1's piecewise graphs, by token bucket).

A prefill (or chunked prefill, recompute, refine-text) step has a different shape every time, so the decode
graphs cannot serve it, and run op by op it costs the host ~30 launches per layer: on an H200 an engine
step that also prefilled took several decode steps of host time. Here the forward is cut at attention:
piece 0 is the first layer's norm, q/k/v projection and RoPE; piece i (1..L-1) is layer i-1's output
projection and MLP plus layer i's norm, q/k/v and RoPE; piece L is the last layer's output half and the
final norm. Each piece is captured once per token bucket (sizes padded up), and only the paged attention,
whose work depends on the sequences' lengths, runs eagerly between the replays: L attention calls and L + 1
replays instead of the whole layer stack.

The pieces read and write static buffers (the bucket's first rows): x and positions in, q / k / v and the
residual between pieces, the attention output back in, the hidden states out. Padding rows hold stale
finite values; they are never attended to (the attention only sees the step's real tokens) and their rows
are dropped. Off CUDA nothing is captured: run() calls the same pieces eagerly on the same buffers, which is
what the CPU tests check against GPT.forward.
"""

from __future__ import annotations

import logging
import time

import torch

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


class PrefillGraphs(BucketedGraphs):
    """Bucketed piecewise graphs of one ModelRunner's GPT (`capture()` before `run()`; with defer=True,
    `capture_next()` captures the other buckets later, largest first: a step's tokens replay the smallest
    captured bucket that holds them)."""

    def __init__(self, runner, sizes: list[int], ops: DecodeOps) -> None:
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

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

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
        """Warm and capture every piece of every bucket, largest first, into one memory pool (defer: the
        largest and smallest buckets only; capture_next() takes the rest). If the torch.compile'd ops fail at
        these shapes, capture again with the same ops uncompiled (slower pieces, never wrong), as the decode
        graphs do."""
        fn = self._capture_first if defer else self._capture_all
        or_uncompiled(self, fn, "capturing the piecewise prefill graphs with compiled ops")

    def _capture_all(self) -> None:
        self._capture_sizes(self._reset_buckets(defer=False))

    def _capture_first(self) -> None:
        self._capture_sizes(self._reset_buckets(defer=True))

    def _capture_sizes(self, sizes: list[int]) -> None:
        t0 = time.perf_counter()
        for t in sizes:
            self._capture_bucket(t)
        self.capture_s = time.perf_counter() - t0
        if self.runner.device.type == "cuda":
            logger.info(
                "captured %d piecewise prefill CUDA graphs (%d token buckets, %d..%d) in %.1f s%s",
                len(sizes) * (self.num_layers + 1),
                len(sizes),
                sizes[-1],
                sizes[0],
                self.capture_s,
                f"; {len(self.pending)} more buckets after start-up, between steps" if self.pending else "",
            )

    @torch.inference_mode()
    def _capture_bucket(self, t: int) -> None:
        """Warm every piece at t tokens (compiles the ops, lets cuBLAS pick its kernels), capture each, then
        replay each once: a graph's first launch uploads it, which belongs here, not in a live step."""
        if self.runner.device.type != "cuda":
            self._add_graph(t, [None] * (self.num_layers + 1))
            return
        torch.cuda.synchronize()  # a step in flight may still read the static buffers the pieces write
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

    def run(self, x: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """GPT forward of x [T, H] at positions [T] with attention context ctx -> hidden [T, H] in the GPT
        dtype: a view of the static output, valid until the next run()."""
        t = x.shape[0]
        b = self.bucket(t)
        self.x[:t].copy_(x)
        self.positions[:t].copy_(positions)
        graphs = self.graphs[b]
        for i in range(self.num_layers + 1):
            if i:
                self.attn[:t].copy_(ctx.attend(i - 1, self.q[:t], self.k[:t], self.v[:t]))
            if graphs[i] is None:
                self._piece(i, b)
            else:
                graphs[i].replay()
        return self.out[:t]
