"""CUDA graphs of the code-stage decode step over batch-size buckets (ARCHITECTURE.md principle 6).

One graph per bucket covers the whole step on the device: the input frames (SamplingState.last_tokens of the
rows), the code embedding, the GPT with paged attention (KV write fused), the heads, the sampler and the
history update. The host fills one pinned int64 array [5, bucket] (row, position, slot, step and sequence
length of each sequence, each a contiguous column the body reads as is: no gather or cast kernels in the graph;
padding rows point at the scratch row with slot -1 and length 0 and so attend to nothing), copies it in one
transfer, replays, and reads the sampled codes back: one small host sync per step.

Captured largest first so that every smaller graph fits in the memory pool of the larger ones; with
`capture(defer=True)` only the largest and smallest are captured at once and `capture_next()` takes the
others later, largest first (the engine does it between served steps: engine/deferred_capture.py), while a
batch whose own bucket is not captured yet replays the smallest captured bucket above it (more padding rows,
the same rows' math). The attention is captured with `max_seq_len = max_model_len`: the Triton kernel freezes
its split count at capture and reads each sequence's length on the device, so one graph serves every context
length up to max_model_len.
Graphs hold the addresses of the runner's persistent tensors; if one of those is reallocated (rows or history
window grew) the runner's `generation` changes and the graphs are captured again before the next replay.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ttsserve.attention.backend import AttentionMetadata, PagedAttention, Rope
from ttsserve.config import decode_gemv
from ttsserve.graph_capture import capture
from ttsserve.layers.quant.linear import GPT_LINEARS
from ttsserve.runner.decode_ops import DecodeOps, fused_gpt_forward, gemv_gpt_forward
from ttsserve.runner.graph_buckets import BucketedGraphs

logger = logging.getLogger(__name__)

_META = _ROW, _POS, _SLOT, _STEP, _SEQ_LEN = range(5)


def _packed(flat: torch.Tensor, num_steps: int, bs: int) -> torch.Tensor:
    """The first num_steps * 5 * bs elements of a flat meta buffer as [num_steps, 5, bs] (contiguous)."""
    return flat[: num_steps * len(_META) * bs].view(num_steps, len(_META), bs)


class _ZeroAttention:
    """An attention context whose output is zeros shaped like the real one's ([T, Hq, D], contiguous)."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)


def capture_graph(body, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """body() captured into a new CUDA graph in `pool` (None: a new one) -> (graph, the pool it is in)."""
    graph = torch.cuda.CUDAGraph()
    capture(graph, body, pool)
    return graph, graph.pool() if pool is None else pool


def or_uncompiled(owner, fn, what: str) -> None:
    """fn(); if it fails while owner.ops (DecodeOps) is compiled (torch.compile'd or Triton kernels), log, give the
    owner the plain functions and run fn() again (slower, never wrong). Any other failure propagates."""
    try:
        fn()
    except Exception as exc:
        if owner.ops is None or not owner.ops.compiled:
            raise
        logger.warning("%s failed (%s: %s); running its ops uncompiled", what, type(exc).__name__, exc)
        owner.ops = DecodeOps(compile=False)
        fn()


def _dense(runner) -> bool:
    """Every GPT linear is a plain nn.Linear (not quantized): what layers/triton_gemv.py reads."""
    layers = runner.model.gpt.layers
    return all(type(getattr(layer, name)) is torch.nn.Linear for layer in layers for name in GPT_LINEARS)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64 and of 16 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs(BucketedGraphs):
    """Bucketed decode-step graphs of one ModelRunner (CUDA only; `capture()` before `run()`)."""

    def __init__(
        self, runner, sizes: list[int], fused: bool = True, compile: bool | None = None, max_steps: int = 1
    ) -> None:
        """fused: run fused_gpt_forward and DecodeOps (all torch.compile'd where `compile`; default:
        DecodeOps.for_device, i.e. $TTSSERVE_DECODE_OPS on CUDA); max_steps: the longest decode burst run()
        replays (multi-step scheduling)."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        self.runner = runner
        if not fused:
            self.ops = None
        elif compile is None:
            self.ops = DecodeOps.for_device(runner.device)
        else:
            self.ops = DecodeOps(compile)
        # $TTSSERVE_DECODE_GEMV (default on): the one-row bucket's GPT as fused GEMVs (dense linears on CUDA only;
        # the uncompiled fallback of or_uncompiled() drops them with the other kernels)
        self.gemv = self.ops is not None and runner.device.type == "cuda" and decode_gemv() and _dense(runner)
        self._init_buckets(sizes)
        max_bs, dev = self.sizes[-1], runner.device
        # Flat buffers, viewed [steps, 5, bs] for a bucket of bs rows (_packed): one step's meta is one contiguous
        # [5, bs] block, which the bucket's graph reads at the start of self.meta.
        self.meta = torch.zeros(len(_META) * max_bs, dtype=torch.int64, device=dev)
        self.max_steps = max_steps
        self._burst_meta = torch.zeros(max_steps * len(_META) * max_bs, dtype=torch.int64, device=dev)
        # Pinned host buffers, one per run() in turn: a run's copy from its buffer may
        # still be queued when the next run is prepared (the engine's async scheduling queues step n + 1 before
        # it waits for step n, and a mixed step may run twice: a burst and single steps); it has run by the
        # time the buffer comes round again, after the wait for step n.
        self._meta_hosts = [
            torch.zeros(max_steps * len(_META) * max_bs, dtype=torch.int64, pin_memory=dev.type == "cuda")
            for _ in range(4)
        ]
        self._turn = 0
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.tokens = torch.zeros(max_bs, runner.cfg.num_vq, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(max_bs, runner.cfg.hidden_size, dtype=torch.float32, device=dev)
        self.generation = None
        self.capture_s = 0.0

    def _host(self, num_steps: int, bs: int) -> torch.Tensor:
        """This turn's pinned meta [num_steps, 5, bs]."""
        return _packed(self._meta_hosts[self._turn], num_steps, bs)

    def load_padding(self, bs: int) -> None:
        """Every row of a bs bucket a padding row, on the device (warm-ups and captures; waits for the copy)."""
        host = self._host(1, bs)
        self._fill_padding(host.numpy())
        self.meta[: len(_META) * bs].copy_(host.reshape(-1))

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    # ---- the captured body ---------------------------------------------------------------------------------
    def _body(self, bs: int, zero_attention: bool = False) -> None:
        """One decode step of `bs` rows from the static buffers into self.tokens / self.hidden (zero_attention:
        zeros for every attention output, which reads no KV cache: precompile())."""
        r = self.runner
        rows, positions, slots, steps, seq_lens = _packed(self.meta, 1, bs)[0]
        seq_lens = seq_lens.to(torch.int32)
        # Host lengths are unknown to a replayed graph: the Triton kernels read seq_lens on the device and only
        # take the split count from max_seq_len. The uncaptured (CPU) body passes the true host values, which
        # the torch reference backend uses.
        if self.runner.device.type == "cuda":
            max_len, lens_cpu = r.max_model_len, [r.max_model_len] * bs
        else:
            lens_cpu = seq_lens.tolist()  # on the CPU the "device" buffer is host memory
            max_len = max(lens_cpu)
        md = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: bs + 1],
            seq_lens=seq_lens,
            block_tables=r.input_batch.block_table[rows],
            slot_mapping=slots,
            max_query_len=1,
            max_seq_len=max_len,
            block_size=r.block_size,
            cu_seqlens_q_cpu=list(range(bs + 1)),
            seq_lens_cpu=lens_cpu,
        )
        if self.ops is None:
            x = r.model.embed.embed_codes(r.sampling.last_tokens[rows])
            self.hidden[:bs] = r._forward(x, md, positions)  # cast to fp32 by the copy
        else:
            x = self.ops.embed_rows(r.model.embed.emb_code, r.sampling.last_tokens, rows, r.model.gpt.dtype)
            ctx = _ZeroAttention() if zero_attention else PagedAttention(r.backend, r.kv.layers, md, r.scale)
            forward = gemv_gpt_forward if self.gemv and self.ops.compiled and bs == 1 else fused_gpt_forward
            self.hidden[:bs] = forward(r.model.gpt, self.ops, x, positions, ctx)
        self.tokens[:bs] = r.sample_rows(self.hidden[:bs], rows, steps, "code", ops=self.ops)

    def _fill_padding(self, m: np.ndarray) -> None:
        """Padding rows in m, meta [num_steps, 5, rows] (a slice of a pinned buffer)."""
        m[:, _ROW] = self.runner.sampling.scratch_row
        m[:, _POS] = m[:, _STEP] = m[:, _SEQ_LEN] = 0
        m[:, _SLOT] = -1

    # ---- capture / replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def precompile(self) -> None:
        """Run the body once at the largest bucket's padding with zeros for attention, before the runner's KV
        cache exists: torch.compile traces and loads the ops now (the runner overlaps it with the KV pool's
        allocation), at the shapes and dtypes the first capture's warm-up then finds compiled. qkv_rotary, which
        the body does not call, is traced here too for the piecewise prefill graphs that share these ops."""
        if self.ops is None or not self.ops.traced or self.runner.device.type != "cuda":
            return
        bs = self.sizes[-1]
        self.load_padding(bs)
        self._or_uncompiled(lambda: self._body(bs, zero_attention=True), "torch.compile of the decode step")
        self._or_uncompiled(lambda: self._trace_qkv_rotary(bs), "torch.compile of the prefill graphs' RoPE")

    def _trace_qkv_rotary(self, t: int) -> None:
        """One call of ops.qkv_rotary on t zero rows of the GPT's qkv width and dtype."""
        gpt = self.runner.model.gpt
        cfg, dev = gpt.cfg, self.runner.device
        qkv = torch.zeros(t, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, dtype=gpt.dtype, device=dev)
        cos, sin = gpt.rotary(torch.zeros(t, dtype=torch.int64, device=dev), gpt.dtype)
        self.ops.qkv_rotary(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def capture(self, defer: bool = False) -> None:
        """Capture every bucket, largest first into one shared memory pool (defer: only the largest and smallest
        now, the rest by capture_next()); if the torch.compile'd ops cannot be captured, capture again with the
        same ops uncompiled. Off CUDA nothing is captured and run() calls the same body eagerly on the static
        buffers (tests of the padding / indexing logic)."""
        self._or_uncompiled(lambda: self._capture_now(defer), "capturing the compiled decode step")

    def _capture_now(self, defer: bool) -> None:
        t0 = time.perf_counter()
        now = self._reset_buckets(defer)
        self.generation = self.runner.generation
        for bs in now:
            self._capture_bucket(bs)
        self.capture_s = time.perf_counter() - t0
        if self.runner.device.type == "cuda":
            logger.info(
                "captured %d decode CUDA graph%s (batch sizes %d..%d) in %.1f s%s",
                len(now),
                "s" if len(now) > 1 else "",
                now[-1],
                now[0],
                self.capture_s,
                f"; {len(self.pending)} more after start-up, between steps" if self.pending else "",
            )

    @torch.inference_mode()
    def _capture_bucket(self, bs: int) -> None:
        """Warm the body up at `bs` rows of padding, capture it, and replay it once on the padding (a graph's
        first launch uploads it: not in a served step). Off CUDA: record the eager body."""
        if self.runner.device.type != "cuda":
            self._add_graph(bs, None)
            return
        torch.cuda.synchronize()  # a step in flight may still copy from the pinned buffer filled next
        self.load_padding(bs)
        self._warm_up(bs)
        graph, self.pool = capture_graph(lambda: self._body(bs), self.pool)
        graph.replay()  # padding rows only: the scratch row's state, no KV slot
        torch.cuda.synchronize()
        self._add_graph(bs, graph)

    def _stale(self) -> bool:
        return self.generation != self.runner.generation

    def _warm_up(self, bs: int) -> None:
        """Run the body once outside the capture (Triton / torch.compile compile, cuBLAS picks its kernels). A
        torch.compile failure falls back to the same functions uncompiled: slower, never wrong."""
        self._or_uncompiled(lambda: self._body(bs), "torch.compile of the decode step")

    def _or_uncompiled(self, fn, what: str) -> None:
        or_uncompiled(self, fn, what)

    def run(
        self, rows: np.ndarray, starts: np.ndarray, steps: np.ndarray, num_steps: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay num_steps decode steps for B = len(rows) rows -> (tokens [B, num_steps, num_vq] int64,
        hidden [num_steps, B, H] fp32). rows / starts / steps: int64 [B] (starts = position) of the first step;
        step j runs at starts + j, steps + j on the frame step j - 1 sampled. One step returns views of the
        static buffers, valid until the next replay; a burst returns new tensors."""
        if self.generation != self.runner.generation:
            logger.info("persistent batch tensors were reallocated: re-capturing the decode graphs")
            self.capture(defer=self.deferred)
        if not 1 <= num_steps <= self.max_steps:
            raise ValueError(f"num_steps must be in [1, {self.max_steps}], got {num_steps}")
        b = len(rows)
        bs = self.bucket(b)
        block_size, table = self.runner.block_size, self.runner.input_batch.block_table_np
        self._turn = (self._turn + 1) % len(self._meta_hosts)
        host = self._host(num_steps, bs)
        whole = host.numpy()
        m, padding = whole[:, :, :b], whole[:, :, b:]
        pos = starts[None, :] + np.arange(num_steps)[:, None]  # [num_steps, B]
        m[:, _ROW] = rows
        m[:, _POS] = pos
        m[:, _SLOT] = table[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
        m[:, _STEP] = steps[None, :] + np.arange(num_steps)[:, None]
        m[:, _SEQ_LEN] = pos + 1
        self._fill_padding(padding)
        n = len(_META) * bs
        if num_steps == 1:
            self.meta[:n].copy_(host.reshape(-1), non_blocking=True)
            self._replay(bs)
            return self.tokens[:b, None], self.hidden[None, :b]
        burst = _packed(self._burst_meta, num_steps, bs)
        burst.copy_(host, non_blocking=True)
        tokens = torch.empty(b, num_steps, self.tokens.shape[1], dtype=self.tokens.dtype, device=self.tokens.device)
        hidden = torch.empty(num_steps, b, self.hidden.shape[1], dtype=self.hidden.dtype, device=self.hidden.device)
        for j in range(num_steps):
            self.meta[:n].copy_(burst[j].reshape(-1))
            self._replay(bs)
            tokens[:, j] = self.tokens[:b]
            hidden[j] = self.hidden[:b]
        return tokens, hidden

    def _replay(self, bs: int) -> None:
        graph = self.graphs[bs]
        if graph is None:
            self._body(bs)
        else:
            graph.replay()
