"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, prefix caching, host swap space.

Pure Python, no tensors: the runner owns the KV tensors; this module only decides which block ids
hold which positions. One position (one text token or one 4-code frame) is one KV slot.

Prefix caching: every FULL block whose KV has been written gets a chain hash
(parent hash, the block's token items, prefix_key, mode). A later request whose leading blocks hash
equal reuses them (ref count + 1). Freed blocks keep their hash and stay reusable until the LRU free
queue hands them out again (eviction). Only blocks whose KV is already computed (before this step) are
registered, so a block is never shared before its KV exists, even if its owner is preempted mid-step.
Prompt blocks are published as soon as they are computed; output blocks (sampled codes, which no other request
repeats) only when their request is preempted by recompute, which then finds its own blocks again. Hashing every
output block as it filled cost the scheduler ~0.7 of its 2.0 ms a step at 512 rows (benchmarks/core_loop_cost.py
--served) and filled the cache with keys nobody could hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice

from ttsserve.constants import FRAMES_PER_SECOND
from ttsserve.engine.request import Request

# Dict key of a cached full block: (chain hash, the block's items), so a hash collision alone never aliases two
# different blocks. A plain tuple, not a NamedTuple: the GC untracks exact tuples of untracked items, and
# the cache holds a key per block it publishes (hundreds of thousands on a GPU while every output block was
# published), which as tracked objects made every full collection of the engine core a 20-55-ms stall of the step
# loop (measured on the H200).
BlockHash = tuple[int, tuple]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """GPU block pool with prefix caching, plus a host (swap) block pool.

    Invariants (checked by tests): every GPU block is either in the free queue (ref_cnt 0) or referenced
    by ref_cnt block tables; num_free_blocks + used == num_gpu_blocks.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_gpu_blocks  # [num_gpu_blocks]
        self.block_hash: list[BlockHash | None] = [None] * num_gpu_blocks  # [num_gpu_blocks]
        # LRU order: the head is handed out (evicted) first. dict ops keep it O(1).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_gpu_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}
        self.cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self._cpu_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of a request's full blocks
        self._num_registered: dict[str, int] = {}  # leading blocks of block_table already considered
        self._pending_stats: dict[str, tuple[int, int]] = {}  # (queried, hit) tokens of an admission
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which found in the cache

    # ---- stats -------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self.cpu_free)

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_gpu_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- allocation --------------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return need <= len(self.free_queue)

    def get_computed_blocks(self, request: Request) -> int:
        """At admission (empty block_table): attach the longest cached prefix of full blocks.

        Returns num_cached_tokens, a multiple of block_size and at most num_tokens - 1, so the last
        token is always computed and the step samples. The caller sets num_computed_tokens to it; if the
        following allocate_slots fails it must free(request) and reset num_computed_tokens to 0.
        """
        assert not request.block_table, f"{request.request_id}: get_computed_blocks with blocks attached"
        if not self.enable_prefix_caching:
            self._pending_stats[request.request_id] = (request.num_tokens, 0)
            return 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        for h in islice(self._chain_hashes(request, num_blocks), num_blocks):
            bid = self.cached_blocks.get(h)
            if bid is None:
                break
            if self.ref_cnt[bid] == 0:
                del self.free_queue[bid]
            self.ref_cnt[bid] += 1
            request.block_table.append(bid)
        self._num_registered[request.request_id] = len(request.block_table)
        num_cached = len(request.block_table) * self.block_size
        # Counted when the admission succeeds (allocate_slots), not per failed attempt.
        self._pending_stats[request.request_id] = (request.num_tokens, num_cached)
        return num_cached

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow block_table to hold positions [0, num_computed_tokens + num_new_tokens).

        Returns False (and changes nothing) when the free queue cannot supply the blocks.
        """
        if num_new_tokens < 1:
            raise ValueError(f"{request.request_id}: num_new_tokens must be >= 1, got {num_new_tokens}")
        bs, computed = self.block_size, request.num_computed_tokens
        # _register_computed's own early exit, inlined: called for every running request every step
        upto = min(computed, request.num_prompt_tokens)
        if self.enable_prefix_caching and upto // bs > self._num_registered.get(request.request_id, 0):
            self._register_computed(request, upto)
        need = -(-(computed + num_new_tokens) // bs) - len(request.block_table)
        if need > 0:  # a decode step mostly lands in its last block
            if need > len(self.free_queue):
                return False
            table = request.block_table
            for _ in range(need):
                table.append(self._pop_free())
        if self._pending_stats:
            queries, hits = self._pending_stats.pop(request.request_id, (0, 0))
            self.prefix_cache_queries += queries
            self.prefix_cache_hits += hits
        return True

    def free(self, request: Request, keep_outputs: bool = False) -> None:
        """Release the request's GPU blocks (its computed full prompt blocks stay cached, and its output blocks
        with keep_outputs: a preemption by recompute) and its host blocks."""
        self._register_computed(request, None if keep_outputs else self._prompt_computed(request))
        self._release(request.block_table)
        request.block_table = []
        self._forget(request.request_id)
        self.cpu_free.extend(self._cpu_tables.pop(request.request_id, ()))

    # ---- swap (host) side --------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return self.blocks_for(request.num_computed_tokens) <= len(self.cpu_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the computed blocks to host blocks; returns [(gpu_block, cpu_block)] copies to run.

        The runner must copy these BEFORE the step's forward: the GPU blocks are free again and may be
        written by other requests in the same step. Slots allocated but not yet computed are dropped.
        """
        n = self.blocks_for(request.num_computed_tokens)
        if n > len(self.cpu_free):
            raise ValueError(f"{request.request_id}: needs {n} host blocks, {len(self.cpu_free)} free")
        self._register_computed(request, self._prompt_computed(request))
        mapping = [(request.block_table[i], self.cpu_free.pop()) for i in range(n)]
        self._cpu_tables[request.request_id] = [c for _, c in mapping]
        self._release(request.block_table)
        request.block_table = []
        self._forget(request.request_id)
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Room for the swapped blocks plus the slots of the next num_new_tokens."""
        return self.blocks_for(request.num_computed_tokens + num_new_tokens) <= len(self.free_queue)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns [(cpu_block, gpu_block)] copies to run before the forward."""
        cpu_table = self._cpu_tables.pop(request.request_id)
        if len(cpu_table) > len(self.free_queue):
            self._cpu_tables[request.request_id] = cpu_table
            raise ValueError(f"{request.request_id}: needs {len(cpu_table)} GPU blocks, {self.num_free_blocks} free")
        assert not request.block_table
        mapping = []
        for c in cpu_table:
            g = self._pop_free()
            request.block_table.append(g)
            mapping.append((c, g))
        self.cpu_free.extend(cpu_table)
        return mapping

    def num_swapped_blocks(self, request: Request) -> int:
        return len(self._cpu_tables.get(request.request_id, ()))

    # ---- internals ---------------------------------------------------------------------------------
    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[bid]
        if h is not None:  # evict: its content is about to be overwritten
            if self.cached_blocks.get(h) == bid:
                del self.cached_blocks[h]
            self.block_hash[bid] = None
        assert self.ref_cnt[bid] == 0, f"block {bid} in the free queue with ref_cnt {self.ref_cnt[bid]}"
        self.ref_cnt[bid] = 1
        return bid

    def _release(self, block_table: list[int]) -> None:
        # Tail blocks first, so a chain's leading (most shareable) blocks are evicted last.
        for bid in reversed(block_table):
            assert self.ref_cnt[bid] > 0, f"double free of block {bid}"
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None
                if self.block_hash[bid] is None:  # nothing worth keeping: hand it out first
                    self.free_queue.move_to_end(bid, last=False)

    def _forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self._pending_stats.pop(request_id, None)

    @staticmethod
    def _prompt_computed(request: Request) -> int:
        return min(request.num_computed_tokens, request.num_prompt_tokens)

    def _register_computed(self, request: Request, upto: int | None = None) -> None:
        """Publish the full blocks whose KV is written below position `upto` (default num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_registered.get(rid, 0)
        num_full = (request.num_computed_tokens if upto is None else upto) // self.block_size
        if num_full <= start:  # the per-step common case: no block completed since the last call
            return
        num_full = min(num_full, len(request.block_table))
        hashes = self._chain_hashes(request, num_full)
        for i in range(start, num_full):
            bid = request.block_table[i]
            if self.block_hash[bid] is None and hashes[i] not in self.cached_blocks:
                self.cached_blocks[hashes[i]] = bid
                self.block_hash[bid] = hashes[i]
            # else: already published, or a duplicate of a block computed by another request
        self._num_registered[rid] = num_full

    def _chain_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's kept chain hashes, computed up to its first num_blocks full blocks (lazily): the list
        itself, maybe longer (not a copy per call: a decode that fills a block calls this)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        extra = (request.prefix_key, request.mode)
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = tuple(request.token_slice(i * bs, (i + 1) * bs))
            parent = hashes[-1][0] if hashes else None
            hashes.append((hash((parent, tokens, extra)), tokens))
        return hashes


# ---- sizing --------------------------------------------------------------------------------------------


def size_kv_pool(memory_bytes: int, bytes_per_token: int, block_size: int = 16) -> int:
    """Number of KV blocks that fit in memory_bytes (bytes_per_token: K+V of all layers for one slot)."""
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
    if bytes_per_token < 1 or block_size < 1:
        raise ValueError(f"bytes_per_token and block_size must be >= 1, got {bytes_per_token}, {block_size}")
    return int(memory_bytes // (bytes_per_token * block_size))


@dataclass(frozen=True)
class KVPoolReport:
    num_blocks: int
    block_size: int
    num_tokens: int  # KV slots (positions/frames) in the pool
    tokens_per_utterance: int  # prompt + frames of one utterance
    blocks_per_utterance: int
    max_concurrent_utterances: int  # utterances whose whole KV fits at once

    def __str__(self) -> str:
        return (
            f"KV pool: {self.num_blocks} blocks x {self.block_size} = {self.num_tokens} tokens; "
            f"{self.max_concurrent_utterances} concurrent utterances of {self.tokens_per_utterance} tokens "
            f"({self.blocks_per_utterance} blocks each)"
        )


def kv_pool_report(
    num_blocks: int, block_size: int = 16, utterance_seconds: float = 30.0, prompt_len: int = 64
) -> KVPoolReport:
    """How many tokens, and how many utterances of utterance_seconds (+ prompt_len positions), fit."""
    if utterance_seconds <= 0 or prompt_len < 0:
        raise ValueError(f"need utterance_seconds > 0 and prompt_len >= 0, got {utterance_seconds}, {prompt_len}")
    frames = cdiv(int(utterance_seconds * FRAMES_PER_SECOND * 1000), 1000)  # ceil without float noise
    per_utt = prompt_len + frames
    blocks = cdiv(per_utt, block_size)
    return KVPoolReport(num_blocks, block_size, num_blocks * block_size, per_utt, blocks, num_blocks // blocks)
