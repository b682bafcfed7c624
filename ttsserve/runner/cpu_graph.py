"""The CPU decode step of the GPT as ONE torch.compile graph ($TTSSERVE_CPU_COMPILE=1; servers default to eager).

Eager, a decode step is ~1,000 small ops and ~9,000 Python calls around the GPT's 80 GEMMs; at 8 streams that
costs more than the GEMMs (int8 W8A8: a 30.6 ms GPT forward against ~12 ms of GEMM). Compiled as one graph,
inductor fuses everything between the GEMMs (norms, RoPE, the KV write, the paged attention, residuals, SiLU):
a step at 8 streams drops from 45.7 to 38.1 ms, at 16 from 82.3 to 57.0 ms (docs/benchmarks-history.md, CPU fast path).

The packed linears (oneDNN bf16/fp32, fbgemm W8A8, int4) are opaque to the tracer, so each runs as the custom op
`ttsserve::cpu_linear`, which calls the module by handle. One graph serves every batch of >= 2 sequences
(dynamic shapes); a batch of 1 runs as 2 identical rows (the copy writes the same KV slot with the same values
and its output is dropped): the GEMMs are memory-bound, so M = 2 costs what M = 1 does, and size 1 would be a
second compilation. A second graph serves a team of one OpenMP thread (the engine's under contention:
runner/cpu_contention.py). Compiling the first takes about a minute on 2 cores, on scratch KV caches, before the
engine is ready (runner/model_runner.py); any failure (no C++ compiler, say) leaves the eager path, never a wrong one.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import Tensor, nn

from ttsserve.attention.backend import AttentionMetadata
from ttsserve.attention.torch_ref import paged_decode_attention
from ttsserve.model.layers import apply_rotary, silu_and_mul

logger = logging.getLogger(__name__)

_LINEARS: dict[int, nn.Module] = {}  # handle -> linear module (modules of every live CpuDecodeGraph)


@torch.library.custom_op("ttsserve::cpu_linear", mutates_args=())
def cpu_linear(x: Tensor, handle: int) -> Tensor:
    """The linear module registered as `handle`, applied to x [T, in] -> [T, out] in x's dtype."""
    return _LINEARS[handle](x)


@cpu_linear.register_fake
def _(x: Tensor, handle: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], _LINEARS[handle].out_features))


def _register(module: nn.Module) -> int:
    handle = id(module)
    _LINEARS[handle] = module
    return handle


class CpuDecodeGraph:
    """gpt: the CPU model's GPT (linears already packed); kv_layers: the engine's caches, one
    [2, num_blocks, block_size, Hkv, D] per layer; scale: the attention scale."""

    def __init__(self, gpt: nn.Module, kv_layers: list[Tensor], scale: float) -> None:
        self.gpt, self.kv_layers, self.scale = gpt, kv_layers, scale
        # the handle is id(module), taken inside the traced code, where it is a constant (a stored int would
        # become a symbolic input of the dynamic graph)
        self.handles = [
            _register(m)
            for layer in gpt.layers
            for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        self.block_size = kv_layers[0].shape[2]
        self._compiled = None
        self._ready = threading.Event()
        self.compile_s: float | None = None

    # ---- the traced step ---------------------------------------------------------------------------------
    def _step(
        self, x: Tensor, positions: Tensor, slots: Tensor, tables: Tensor, seq_lens: Tensor, caches: list[Tensor]
    ) -> Tensor:
        """x: [B, H] embeddings; positions, slots: [B] int64; tables: [B, nb] int; seq_lens: [B] int (context
        incl. the new token) -> [B, H] final hidden states in the model dtype. Writes each layer's new k / v."""
        gpt, b = self.gpt, x.shape[0]
        cfg = gpt.cfg
        nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = x.to(gpt.dtype)
        cos, sin = gpt.rotary(positions, h.dtype)
        for layer, cache in zip(gpt.layers, caches):
            q, k, v = cpu_linear(layer.input_layernorm(h), id(layer.qkv_proj)).split([nq * d, nkv * d, nkv * d], dim=-1)
            q = apply_rotary(q.reshape(b, nq, d), cos, sin)
            k = apply_rotary(k.reshape(b, nkv, d), cos, sin)
            _, num_blocks, block_size = cache.shape[:3]
            kv = torch.stack((k, v.reshape(b, nkv, d))).to(cache.dtype)
            cache.view(2, num_blocks * block_size, nkv, d).index_copy_(1, slots, kv)
            attn = paged_decode_attention(q.float(), cache[0], cache[1], tables, seq_lens, self.scale)
            h = h + cpu_linear(attn.to(h.dtype).reshape(b, nq * d), id(layer.o_proj))
            up = cpu_linear(layer.post_attention_layernorm(h), id(layer.gate_up_proj))
            h = h + cpu_linear(silu_and_mul(up), id(layer.down_proj))
        return gpt.norm(h)

    # ---- compile -----------------------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Compile (in a daemon thread with `background`); `ready` turns true once the graph can be used."""
        if not background:
            self._compile()
            return
        threading.Thread(target=self._compile, name="ttsserve-cpu-graph", daemon=True).start()

    def _compile(self) -> None:
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(self._step)
            # like the engine's: caches made outside inference mode, the step's inputs inside (a tensor's
            # dispatch keys are guarded, and a mismatch would recompile in the first real step)
            caches = [c.new_zeros(2, 11, *c.shape[2:]) for c in self.kv_layers]
            with torch.inference_mode():
                inputs = self._warmup_inputs(caches[0].shape[1])
                # only the batch, the table width and the cache's block count vary; every other size stays
                # static, so inductor emits loops over known head sizes
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 0)  # (assumed >= 2: a batch of 1 runs as 2)
                torch._dynamo.mark_dynamic(inputs[3], 1)
                for c in caches:
                    torch._dynamo.mark_dynamic(c, 1)
                compiled(*inputs, caches)
                self._compile_single_thread(compiled, inputs, caches)
            self._compiled = compiled
            self.compile_s = time.perf_counter() - t0
            logger.info("CPU decode step compiled in %.1f s (one graph, and one for a single thread)", self.compile_s)
        except Exception as e:  # noqa: BLE001 - any inductor / compiler failure: the eager path stays
            logger.warning(
                "torch.compile of the CPU decode step failed (%s: %s); staying eager",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
        finally:
            self._ready.set()

    @staticmethod
    def _compile_single_thread(compiled, inputs: tuple, caches: list) -> None:
        """The graph again for one OpenMP thread: the engine drops its team to 1 while other work holds its cores
        (runner/cpu_contention.py), and dynamo guards the thread count, so the first contended step would
        otherwise compile (seconds on 2 cores) in a served step."""
        threads = torch.get_num_threads()
        if threads == 1:
            return
        torch.set_num_threads(1)
        try:
            compiled(*inputs, caches)
        finally:
            torch.set_num_threads(threads)

    def _warmup_inputs(self, num_blocks: int) -> tuple:
        """3 sequences over 5-block tables of `num_blocks` (11) scratch blocks: sizes that equal no other
        dimension (inductor would tie equal sizes and recompile when they part) and never 1 (it specialises 1)."""
        b, nb, bs = 3, 5, self.block_size
        tables = torch.arange(b * nb, dtype=torch.int32).view(b, nb) % num_blocks
        seq_lens = torch.tensor([4 * bs + 1, 4 * bs + 5, 5 * bs], dtype=torch.int32)
        positions = seq_lens.long() - 1
        slots = tables[torch.arange(b), positions // bs].long() * bs + positions % bs
        x = torch.randn(b, self.gpt.cfg.hidden_size)
        return x, positions, slots, tables, seq_lens

    @property
    def ready(self) -> bool:
        """The compiled graph can be used (False while compiling, and for good after a failure)."""
        return self._compiled is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiling has ended (ready or failed); False on timeout."""
        return self._ready.wait(timeout)

    # ---- run ---------------------------------------------------------------------------------------------
    def run(self, x: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor | None:
        """One decode-only step (one new token per sequence) through the graph: [B, H] hidden states, or None
        when it is not ready or fails (the caller then runs the eager step)."""
        if self._compiled is None:
            return None
        b, width = md.block_tables.shape
        # >= 2 blocks and row stride nb, as in the warm-up: a size-1 dim or a slice's stride would recompile
        nb = min(max(-(-md.max_seq_len // self.block_size), 2), width)
        tables = md.block_tables[:, :nb].contiguous()
        slots, seq_lens = md.slot_mapping.long(), md.seq_lens
        if b == 1:
            x, positions, slots, tables, seq_lens = (
                t.expand(2, *t.shape[1:]).contiguous() for t in (x, positions, slots, tables, seq_lens)
            )
        try:
            return self._compiled(x, positions, slots, tables, seq_lens, self.kv_layers)[:b]
        except Exception as e:  # noqa: BLE001
            logger.warning("the compiled CPU decode step failed (%s: %s); staying eager", type(e).__name__, e)
            self._compiled = None
            return None

    def close(self) -> None:
        for h in self.handles:
            _LINEARS.pop(h, None)
