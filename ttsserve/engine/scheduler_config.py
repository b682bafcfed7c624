"""The scheduler's knobs, validated (engine/scheduler.py reads them; EngineConfig builds them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap", "auto"]


@dataclass
class SchedulerConfig:
    """max_num_batched_tokens: tokens of one forward pass over the whole batch (>= max_num_seqs): a prefill chunk
        counts its positions, a decode one, and a decode burst's row one too (its k positions are k passes).
    enable_chunked_prefill: split prompts (and recompute prefills) across steps; without it a prompt
        larger than the remaining budget waits, so then max_num_batched_tokens must be >= max_model_len.
    max_model_len: positions per request (prompt + outputs).
    preemption_mode: "recompute" frees the blocks and re-prefills later; "swap" copies them to host
        (needs host blocks) and falls back to recompute while the host pool is full; "auto" swaps when
        host blocks are free, else recomputes.
    long_prefill_token_threshold: with chunked prefill, max tokens one request computes per step (0: off).
    admission_interval: while requests run, waiting ones are admitted on every k-th step only, together: a
        step that prefills costs more than a decode step (on a GPU it cannot replay a graph whole), so k
        arrivals share one instead of slowing k steps. An idle batch admits at once.
    num_scheduler_steps: a code decode is a burst of this many decode steps per schedule() (multi-step
        scheduling): the device chains them (each step's input is the previous step's sample), so the host's
        per-step work is paid once per burst. A burst ends early on EOS or max_new_tokens: the samples after
        it are dropped. A request without room for a whole burst under the length limit decodes one by one.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    max_model_len: int = 4096
    preemption_mode: PreemptionMode = "auto"
    long_prefill_token_threshold: int = 0
    admission_interval: int = 1
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_scheduler_steps <= 16:
            raise ValueError(f"num_scheduler_steps must be in [1, 16], got {self.num_scheduler_steps}")
        if self.admission_interval < 1:
            raise ValueError(f"admission_interval must be >= 1, got {self.admission_interval}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}), or a recompute could never be scheduled"
            )
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute|swap|auto, got {self.preemption_mode!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
