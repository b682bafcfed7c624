"""TorchPagedAttention: the CPU paged attention backend (and the test oracle of the CUDA kernels).

Decode-only batches (one new token per sequence) are one padded SDPA over every sequence's pages, gathered
with ONE `index_select` per layer into a reused scratch buffer; batches with prefill chunks loop over
sequences (simple beats fast there: prefill is a small part of a ChatTTS request).

Why this shape on CPU (benchmarks/cpu_kernels.py, docs/benchmarks-history.md):
- `index_select` along dim 0 of the cache viewed as [2 * num_blocks, page] copies whole pages
  (block_size * Hkv * D contiguous values, a memcpy each) and is 5-10x faster than advanced indexing
  `kv_cache[:, block_table]` or an index_select along the block axis of [2, num_blocks, page];
- the scratch buffer is kept: a fresh tensor of tens of MB per layer per step is an mmap + page faults;
- the attention math runs in fp32 whatever the cache dtype: torch's CPU SDPA is 2-3x slower in bf16 than
  in fp32, and a bf16 cache already halves the bytes gathered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ttsserve.attention.backend import AttentionMetadata, Rope, rope_qk
from ttsserve.attention.dense import causal_sdpa
from ttsserve.config import compile_level

logger = logging.getLogger(__name__)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k / v ([T, Hkv, D]) at flat slots (block_id * block_size + offset); slots < 0 are padding
    tokens and are not stored. kv_cache: [2, num_blocks, block_size, Hkv, D], written in place."""
    store_kv(kv_cache, k, v, *stored_slots(slot_mapping))


def stored_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots [T] int64, keep [T] bool or None when every slot is stored) of a step's slot_mapping; the same
    for every layer (TorchPagedAttention builds it once per step)."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # a host sync; free on CPU, acceptable in the reference backend elsewhere
        keep = slots >= 0
        return slots[keep], keep
    return slots, None


def store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None
) -> None:
    """write_kv for stored_slots' (slots, keep)."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    kv = torch.stack((k, v)).to(kv_cache.dtype)  # [2, T, Hkv, D]: one index_copy_ for both
    if keep is not None:
        kv = kv[:, keep]
    kv_cache.view(2, num_blocks * block_size, hkv, d).index_copy_(1, slots, kv)


def kv_page_ids(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Rows of the cache viewed as [2 * num_blocks, page] holding the K pages, then the V pages, of
    `block_ids` [n]: [2n] int64. A gather along dim 0 of a contiguous tensor is a memcpy per row; along
    any other dim torch's CPU index_select takes a per-element path (~5x slower)."""
    ids = block_ids.long()
    return torch.cat((ids, ids + num_blocks))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's context: block_table [num_blocks_of_seq] -> k, v: [ctx_len, Hkv, D]."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    nb = -(-ctx_len // block_size)
    pages = kv_cache.view(2 * num_blocks, -1).index_select(0, kv_page_ids(block_table[:nb], num_blocks))
    pages = pages.view(2, nb * block_size, hkv, d)[:, :ctx_len]
    return pages[0], pages[1]


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its paged context, in fp32.

    q: [B, Hq, D] fp32; k_pages / v_pages: [num_blocks, block_size, Hkv, D] (any float dtype);
    block_tables: [B, nb] int (nb * block_size >= every seq_len; padding ids must be valid blocks);
    seq_lens: [B] int (>= 1). Returns [B, Hq, D] fp32.

    Written as page gathers feeding elementwise products and reductions, not matmuls, so that inductor fuses
    each of q.k and p.v into ONE pass over the pages read straight from the cache (no gathered copy, no
    fp32 copy of a bf16 cache): 3-6x faster than gather + SDPA on CPU (benchmarks/cpu_kernels.py).
    """
    b, nb = block_tables.shape
    block_size, hkv, d = k_pages.shape[1:]
    hq = q.shape[1]
    length = nb * block_size
    ids = block_tables.long()
    k = k_pages[ids].reshape(b, length, hkv, 1, d).float()
    scores = (q.reshape(b, 1, hkv, hq // hkv, d) * k).sum(-1) * scale  # [B, L, Hkv, rep]
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    probs = scores.masked_fill(~valid[:, :, None, None], float("-inf")).softmax(dim=1)
    v = v_pages[ids].reshape(b, length, hkv, 1, d).float()
    return (probs[..., None] * v).sum(1).reshape(b, hq, d)


def _attend_rows(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: int,
    lo: int,
    hi: int,
    scale: float,
) -> None:
    """out[lo:hi] = causal attention of q[lo:hi], the last hi - lo positions of a sequence's first ctx_len,
    over those ctx_len cached tokens, in fp32."""
    kb, vb = gather_kv(kv_cache, block_table, ctx_len)
    out[lo:hi] = causal_sdpa(q[lo:hi].float(), kb.float(), vb.float(), scale).to(out.dtype)


_compiled_decode = None  # torch.compile(paged_decode_attention): one compilation per process


def _compiled_paged_decode():
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = torch.compile(paged_decode_attention, dynamic=True)
    return _compiled_decode


class TorchPagedAttention:
    """PagedAttentionBackend in plain torch (see attention/backend.py for the contract).

    compile_decode: run decode-only steps on a CPU cache through torch.compile(paged_decode_attention);
    None: when $TTSSERVE_CPU_COMPILE is "attention" or "1" (servers default to "0", eager: it costs ~5 s of
    compilation per process, which warmup(background=True) hides, and pays off only at larger batches on some
    CPUs: benchmarks/cpu_kernels.py). Any
    compilation failure (e.g. no C++ compiler) falls back, once and for good, to the eager gather + SDPA
    path: slower, never wrong. Holds scratch buffers reused across layers and steps: one instance per
    engine thread.
    """

    name = "torch_ref"

    def __init__(self, compile_decode: bool | None = None) -> None:
        if compile_decode is None:
            compile_decode = compile_level() != "0"
        self.compile_decode = compile_decode
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._step: tuple[AttentionMetadata, int, torch.Tensor, torch.Tensor | None] | None = None
        self._tables: tuple[AttentionMetadata, torch.Tensor] | None = None  # _compiled_tables' step cache
        self._slots: tuple[AttentionMetadata, torch.Tensor, torch.Tensor | None] | None = None  # _stored_slots'
        self._compiled_ready: threading.Event | None = None  # set by a background warmup() when done

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        rope: Rope | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; rope: (cos, sin)
        to rotate q / k with first (backend.rope_qk), None when they are rotated already.

        Writes k / v at md.slot_mapping, then for each sequence attends its new queries (the LAST q_len
        positions of its context of md.seq_lens tokens) causally over that context. Returns [T, Hq, D]
        in q's dtype (computed in fp32 when the cache is bf16 / fp16).
        """
        q, k = rope_qk(q, k, rope)
        store_kv(kv_cache, k, v, *self._stored_slots(md))
        if md.is_decode_only and q.shape[0] == md.num_seqs:
            ready = self._compiled_ready is None or self._compiled_ready.is_set()
            if self.compile_decode and ready and kv_cache.device.type == "cpu":
                out = self._decode_compiled(q, kv_cache, md, scale)
                if out is not None:
                    return out
            return self._decode(q, kv_cache, md, scale)
        out = torch.empty_like(q)
        cu = md.cu_seqlens_q_cpu
        for b, ctx_len in enumerate(md.seq_lens_cpu):
            if cu[b + 1] > cu[b]:
                _attend_rows(out, q, kv_cache, md.block_tables[b], ctx_len, cu[b], cu[b + 1], scale)
        return out

    def prefill_tiled(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        tiles: torch.Tensor,
        block_m: int,
    ) -> None:
        """The reference of TritonPagedAttention.prefill_tiled (q / k rotated): the step read from md's tensors
        alone (as a CUDA graph's static buffers hold it) and each listed tile, (sequence, query block) of
        tiles [num_tiles, 2] with -1 unused, attended on its own into out; rows in no tile are left as they are."""
        write_kv(kv_cache, k, v, md.slot_mapping)
        cu, lens = md.cu_seqlens_q.tolist(), md.seq_lens.tolist()
        for b, block in tiles.tolist():
            if b < 0:
                continue
            lo, hi = cu[b] + block * block_m, min(cu[b] + (block + 1) * block_m, cu[b + 1])
            ctx_len = lens[b] - (cu[b + 1] - hi)  # the context up to the tile's last query
            _attend_rows(out, q, kv_cache, md.block_tables[b], ctx_len, lo, hi, scale)

    def _stored_slots(self, md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """stored_slots(md.slot_mapping), built once per step: every layer shares `md`."""
        if self._slots is None or self._slots[0] is not md:
            self._slots = (md, *stored_slots(md.slot_mapping))
        return self._slots[1], self._slots[2]

    def _decode_compiled(
        self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor | None:
        """The decode step through the compiled kernel; None (and compile_decode off) if it cannot compile."""
        tables = self._compiled_tables(md, kv_cache.shape[2])
        try:
            out = _compiled_paged_decode()(q.float(), kv_cache[0], kv_cache[1], tables, md.seq_lens, scale)
        except Exception as e:  # noqa: BLE001 - any inductor / compiler failure: use the eager path
            logger.warning(
                "torch.compile of the CPU decode attention failed (%s: %s); using gather + SDPA",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self.compile_decode = False
            return None
        return out.to(q.dtype)

    def _compiled_tables(self, md: AttentionMetadata, block_size: int) -> torch.Tensor:
        """The block table the compiled kernel reads, built once per step (every layer shares `md`): at least
        2 blocks and row stride nb, as in warmup(). torch.compile specialises a size of 1 and a table slice's
        row stride, and either would recompile (seconds) inside a request. Padding ids are valid blocks and
        seq_lens masks them out."""
        cached = self._tables
        if cached is not None and cached[0] is md:
            return cached[1]
        b, width = md.block_tables.shape
        nb = min(max(-(-md.max_seq_len // block_size), 2), width)
        tables = md.block_tables.new_empty((b, nb)).copy_(md.block_tables[:, :nb])
        self._tables = (md, tables)
        return tables

    def warmup(
        self, kv_cache: torch.Tensor, num_heads: int, background: bool = False, then: Callable[[], None] | None = None
    ) -> None:
        """Compile the decode kernel now (one and several sequences, under inference mode like the engine's
        steps) rather than in the first request's first step. No-op when compile_decode is off. With
        `background`, compile in a daemon thread and run the eager path until it is done: a server is ready
        at once (the compile takes ~5 s even with inductor's cache warm) and gets faster a few seconds later.
        `then` runs next in the same thread (compilations one after the other). Only reads `kv_cache`."""
        if not (self.compile_decode and kv_cache.device.type == "cpu"):
            return
        if not background:
            self._compile_now(kv_cache, num_heads)
            return
        self._compiled_ready = ready = threading.Event()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self._compile_now(kv_cache, num_heads)
                if self.compile_decode:
                    logger.info(
                        "CPU decode attention compiled in %.1f s",
                        time.perf_counter() - t0,
                    )
            finally:
                ready.set()
                if then is not None:  # whatever happened here: whoever waits for `then` must not hang
                    then()

        threading.Thread(target=run, name="ttsserve-cpu-compile", daemon=True).start()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until a background warmup() has finished (True at once when none runs); False on timeout.
        Benchmarks call it so that they time the steady state, not the eager start."""
        return self._compiled_ready is None or self._compiled_ready.wait(timeout)

    def _compile_now(self, kv_cache: torch.Tensor, num_heads: int) -> None:
        block_size, d = kv_cache.shape[2], kv_cache.shape[4]
        # 1 row (specialised), then 3 rows over 5 blocks: sizes that equal no other dimension, so that the
        # dynamic graph does not tie the batch or block count to another size ("duck sizing").
        blocks = list(range(min(5, kv_cache.shape[1])))
        with torch.inference_mode():
            for b in (1, 3):
                q = torch.zeros(b, num_heads, d, dtype=kv_cache.dtype)
                md = make_metadata([blocks] * b, [(len(blocks) - 1) * block_size] * b, [1] * b, block_size)
                if self._decode_compiled(q, kv_cache, md, d**-0.5) is None:
                    return

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        """One new token per sequence: a single padded SDPA over [B, max_seq_len] keys with a length mask
        (no mask for a single sequence: its context is exactly the gathered length)."""
        b, hq, d = q.shape
        _, num_blocks, block_size, hkv, _ = kv_cache.shape
        page_ids, mask = self._step_tensors(md, num_blocks, block_size)
        width = page_ids.numel() // (2 * b) * block_size  # padded context length of every row
        pages = self._gather(kv_cache.view(2 * num_blocks, -1), page_ids)
        kv = pages.view(2, b, width, hkv, d)[:, :, : md.max_seq_len]
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Hkv, L, D]
        if hq != hkv:
            keys = keys.repeat_interleave(hq // hkv, dim=1)
            values = values.repeat_interleave(hq // hkv, dim=1)
        out = F.scaled_dot_product_attention(q.float()[:, :, None, :], keys, values, attn_mask=mask, scale=scale)
        return out[:, :, 0, :].to(q.dtype)

    def _step_tensors(
        self, md: AttentionMetadata, num_blocks: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(page rows [2 * B * nb] (kv_page_ids of every row's first nb blocks), length mask [B, 1, 1, L]
        or None), built once per step: every layer shares the step's metadata object and cache shape."""
        if self._step is not None and self._step[0] is md and self._step[1] == num_blocks:
            return self._step[2], self._step[3]
        nb = -(-md.max_seq_len // block_size)
        block_ids = kv_page_ids(md.block_tables[:, :nb].reshape(-1), num_blocks)
        mask = None
        if md.num_seqs > 1 and min(md.seq_lens_cpu) < md.max_seq_len:
            pos = torch.arange(md.max_seq_len, device=block_ids.device)
            mask = (pos[None, :] < md.seq_lens.to(block_ids.device).long()[:, None])[:, None, None, :]
        self._step = (md, num_blocks, block_ids, mask)
        return block_ids, mask

    def _gather(self, flat: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
        """flat [2 * num_blocks, page] -> [len(page_ids), page] fp32, in reused scratch memory."""
        shape = (page_ids.numel(), flat.shape[1])
        pages = torch.index_select(flat, 0, page_ids, out=self._buffer(flat.dtype, shape, flat.device))
        if pages.dtype == torch.float32:
            return pages
        return self._buffer(torch.float32, shape, flat.device).copy_(pages)

    def _buffer(self, dtype: torch.dtype, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
        n = shape[0] * shape[1]
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())), dtype=dtype, device=device)
            self._scratch[dtype] = buf
        return buf[:n].view(shape)


def make_metadata(
    block_tables: list[list[int]],
    num_computed_tokens: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """AttentionMetadata for one step from host lists (tests and simple callers).

    block_tables[i]: physical block ids of sequence i (enough for num_computed + num_new tokens);
    sequence i's new tokens sit at positions num_computed_tokens[i] .. + num_new_tokens[i] - 1.
    """
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens)]
    for i, (bt, n) in enumerate(zip(block_tables, seq_lens)):
        if len(bt) * block_size < n:
            raise ValueError(f"sequence {i}: {len(bt)} blocks of {block_size} cannot hold {n} tokens")
    cu = [0]
    slots: list[int] = []
    for bt, c, n in zip(block_tables, num_computed_tokens, num_new_tokens):
        cu.append(cu[-1] + n)
        slots += [bt[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max((len(bt) for bt in block_tables), default=0)
    table = [bt + [0] * (width - len(bt)) for bt in block_tables]
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device).reshape(len(table), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(num_new_tokens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
    )
