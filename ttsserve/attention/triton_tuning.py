"""TritonTuning, the CUDA paged-attention backend's launch parameters, and the decode split heuristic
(triton_paged.py launches the kernels with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TritonTuning:
    """Launch parameters (defaults: the best or near-best of a sweep on an H200, benchmarks/attention_micro.py).
    Tile sizes are KV tokens per loop step (powers of two; >= 16 where they feed a tensor-core dot); prefill_block_m
    None: by max_query_len."""

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # One query row per KV head (GROUP == 1, ChatTTS's case): which caches decode on the CUDA cores
    # (triton_decode_lanes.py, tiles of decode_lanes_rows lanes: tokens x KV heads, software-pipelined
    # decode_lanes_num_stages deep; None: not pipelined) instead of tensor-core dots: "fp8", "all" or "none".
    decode_lanes: str = "fp8"
    decode_lanes_rows: int = 32
    decode_lanes_num_warps: int = 4
    decode_lanes_num_stages: int | None = 3
    # KV heads a lanes program takes at most (a power of two; lanes_heads picks per batch). A token's heads are read
    # as one run and the program's fixed work is shared; fewer programs, though, fill fewer multiprocessors. H100,
    # 20 layers, ms (benchmarks/attention_micro.py --kv), fp8 cache, one head / four heads a program: 512 rows of
    # 32 / 150 / 300 frames 1.07 / 0.60, 1.62 / 1.26, 2.84 / 2.05 (bf16 cache as dots: 0.70, 1.87, 3.40); 256 x 150
    # 0.90 / 0.67; 64 x 300 0.43 / 0.47; 1 x 469 0.13 / 0.14.
    decode_lanes_heads: int = 4
    # lanes_heads keeps at least this many programs a multiprocessor (0: always decode_lanes_heads, for tests).
    decode_lanes_programs_per_sm: int = 4
    min_tokens_per_split: int = 32
    max_splits: int = 32
    prefill_block_m: int | None = None
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2

    def __post_init__(self) -> None:
        if self.decode_lanes not in ("fp8", "all", "none"):
            raise ValueError(f"decode_lanes must be 'fp8', 'all' or 'none', got {self.decode_lanes!r}")
        if self.decode_lanes_rows < 1 or self.decode_lanes_rows & (self.decode_lanes_rows - 1):
            raise ValueError(f"decode_lanes_rows must be a power of two, got {self.decode_lanes_rows}")
        if self.decode_lanes_num_stages is not None and self.decode_lanes_num_stages < 1:
            raise ValueError(f"decode_lanes_num_stages must be None or >= 1, got {self.decode_lanes_num_stages}")
        heads = self.decode_lanes_heads
        if heads < 1 or heads & (heads - 1):
            raise ValueError(f"decode_lanes_heads must be a power of two, got {heads}")
        if heads > self.decode_lanes_rows:
            raise ValueError(
                f"decode_lanes_heads ({heads}) must not exceed decode_lanes_rows ({self.decode_lanes_rows})"
            )
        if self.decode_lanes_programs_per_sm < 0:
            raise ValueError(f"decode_lanes_programs_per_sm must be >= 0, got {self.decode_lanes_programs_per_sm}")

    def uses_lanes(self, group: int, fp8: bool) -> bool:
        """Whether a decode with `group` query heads per KV head on an fp8 (or not) cache runs the lanes."""
        return group == 1 and (self.decode_lanes == "all" or (self.decode_lanes == "fp8" and fp8))

    def lanes_heads(self, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
        """KV heads per lanes program: the most, up to decode_lanes_heads and dividing num_kv_heads, that still
        give decode_lanes_programs_per_sm programs a multiprocessor; one when none does (the split count then
        fills the device)."""
        heads = math.gcd(self.decode_lanes_heads, num_kv_heads)  # a power of two dividing num_kv_heads
        while heads > 1 and num_seqs * num_kv_heads // heads < self.decode_lanes_programs_per_sm * num_sms:
            heads //= 2
        return heads

    def lanes_heads_choices(self, num_kv_heads: int) -> list[int]:
        """Every count lanes_heads may pick for a model with num_kv_heads: 1, 2, ... up to the most it allows."""
        most = math.gcd(self.decode_lanes_heads, num_kv_heads)
        return [1 << i for i in range(most.bit_length())]


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int, tuning: TritonTuning) -> int:
    """Flash-decoding split count: enough programs (num_programs per split) to put about four on every
    multiprocessor, but no split shorter than `tuning.min_tokens_per_split` tokens (below that the
    partial writes and the reduce launch cost more than the parallelism buys). On an H200 (132 SMs,
    12 KV heads) this picks 1 split from batch 44 up, and e.g. 8 at batch 8, 32 at batch 1 / context 1500."""
    target_programs = 4 * num_sms
    num_programs = max(num_programs, 1)
    if num_programs >= target_programs:
        return 1
    by_occupancy = triton.next_power_of_2(triton.cdiv(target_programs, num_programs))
    by_length = max(max_seq_len // tuning.min_tokens_per_split, 1)
    return max(1, min(by_occupancy, by_length, tuning.max_splits))
