"""TritonTuning, the CUDA paged-attention backend's launch parameters, and the decode split heuristic
(triton_paged.py launches the kernels with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TritonTuning:
    """Launch parameters (defaults: the best or near-best of a sweep on an H200, benchmarks/attention_micro.py).
    Tile sizes are KV tokens per loop step (powers of two >= 16); prefill_block_m None: by max_query_len."""

    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # One query row per KV head (GROUP == 1, ChatTTS's case): which caches decode on the CUDA cores
    # (triton_common.attend_lanes, tiles of decode_lanes_block_n) instead of tensor-core dots: "fp8", "all" or
    # "none". H100, 512 rows of 300 frames, 20 layers: fp8 cache 2.83 ms as lanes of 32, 3.94-4.15 as dots;
    # bf16 cache 3.58 ms as dots, 3.58-3.67 as lanes (benchmarks/attention_micro.py --kv). At 150 frames fp8
    # lanes 1.61, bf16 dots 1.96; at 32 frames 1.03 against 0.70 (the lanes' fixed work a program).
    decode_lanes: str = "fp8"
    decode_lanes_block_n: int = 32
    decode_lanes_num_warps: int = 4
    # Tiles in flight in the lanes' loop (LOOP_STAGES in paged_decode_kernel); None: not pipelined. H100, 512
    # rows, fp8 cache: 3 stages 2-3 % faster at 150-300 frames of context, 18 % slower at 32 (one or two tiles);
    # the bf16 lanes 6-13 % faster (benchmarks/attention_micro.py --kv).
    decode_lanes_num_stages: int | None = 3
    # KV heads a lanes program takes (a power of two; the largest that divides the model's KV heads is used).
    decode_lanes_heads: int = 1
    min_tokens_per_split: int = 32
    max_splits: int = 32
    prefill_block_m: int | None = None
    prefill_block_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2

    def __post_init__(self) -> None:
        if self.decode_lanes not in ("fp8", "all", "none"):
            raise ValueError(f"decode_lanes must be 'fp8', 'all' or 'none', got {self.decode_lanes!r}")
        if self.decode_lanes_num_stages is not None and self.decode_lanes_num_stages < 1:
            raise ValueError(f"decode_lanes_num_stages must be None or >= 1, got {self.decode_lanes_num_stages}")
        heads = self.decode_lanes_heads
        if heads < 1 or heads & (heads - 1):
            raise ValueError(f"decode_lanes_heads must be a power of two, got {heads}")

    def uses_lanes(self, group: int, fp8: bool) -> bool:
        """Whether a decode with `group` query heads per KV head on an fp8 (or not) cache runs the lanes."""
        return group == 1 and (self.decode_lanes == "all" or (self.decode_lanes == "fp8" and fp8))

    def lanes_heads(self, num_kv_heads: int) -> int:
        """KV heads per lanes program: decode_lanes_heads, or the largest power of two below it dividing them."""
        return math.gcd(self.decode_lanes_heads, num_kv_heads)


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
