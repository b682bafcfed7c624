"""The runner's data contracts: a sequence's prompt inputs, a launched step, a step's results, timings."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ttsserve.params import SamplingParams


@dataclass
class SequenceInputs:
    """The prompt of one engine sequence, as the front end built it.

    ids: int64 [P, num_vq] (a text position repeats its id in every column; audio-prompt rows hold 4 codes).
    text_mask: bool [P] (False on audio-prompt rows).
    spk_emb: fp16 [hidden] or None (replaces the embedding at the [spk_emb] position).
    """

    ids: torch.Tensor
    text_mask: torch.Tensor
    spk_emb: torch.Tensor | None
    mode: str  # "code" | "text"
    params: SamplingParams
    seed: int


@dataclass
class SequenceState:
    """A sequence's prompt, kept on the host and embedded chunk by chunk with the rest of the step's rows
    (ModelRunner._gather_inputs): admitting a request queues no device work.

    prompt_ids: int64 [P, num_vq]; prompt_text_mask: bool [P]; spk: the L2-normalized speaker vector, fp32
    [H] on the host, or None; spk_rows: int64 prompt positions that spk replaces (empty without one).
    """

    prompt_ids: np.ndarray
    prompt_text_mask: np.ndarray
    spk: torch.Tensor | None
    spk_rows: np.ndarray
    mode: str
    params: SamplingParams
    seed: int

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_ids.shape[0]


@dataclass
class RunnerOutput:
    """sampled[req_id]: for requests that sampled this step, a 4-tuple of codes (code) or a token id (text);
    for a decode burst (ScheduledRequest.num_steps > 1) the sequence (a tuple) of its frames before the first EOS.
    stopped[req_id]: the sampled row is EOS (any codebook for code), or the burst reached one.
    frames: the hidden states of every code frame sampled, the Decoder's input (MODEL.md §4.5), as one (req_ids,
    hidden [m, len(req_ids), H] fp32 on the device) batch per code group: the m frames of this step of each listed
    request (m > 1 in decode bursts), EOS frames and those after them included. Which are real audio frames is
    the scheduler's to say: a request's first RequestUpdate.num_new_tokens (none for a row without an update).
    Each is a tensor of its own (no view of a buffer a later step rewrites), so a reader on another CUDA stream
    may hold it. done: the step's completion event on CUDA (already waited for: every frame is written), which
    such a reader's stream waits on; None off CUDA.
    """

    sampled: dict[str, object] = field(default_factory=dict)
    stopped: dict[str, bool] = field(default_factory=dict)
    frames: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)
    done: object | None = None


@dataclass
class StepGroup:
    """Rows of a launched step that sampled together: req_ids [B]; tokens int64 [B, num_steps, width] on the
    device (width num_vq for code, 1 for text); hidden fp32 [num_steps, B, H] for code (None for text)."""

    mode: str
    req_ids: list[str]
    tokens: torch.Tensor
    hidden: torch.Tensor | None
    num_steps: int = 1


@dataclass
class LaunchedStep:
    """A step queued on the device: its StepGroups, and the sampled tokens' host copy (pinned; `event` marks
    its arrival, None when already there)."""

    groups: list[StepGroup]
    host: torch.Tensor
    event: object | None


@dataclass
class RunnerTimings:
    """Host wall time spent in the runner, summed over steps (ms): prepare_ms = input packing and queueing
    the step (launch), forward_ms = waiting for the device (wait), output_ms = the per-request results."""

    steps: int = 0
    graph_steps: int = 0  # steps whose decode rows replayed a graph
    mixed_graph_steps: int = 0  # of those, steps that also ran prefill / text rows eagerly
    prefill_graph_steps: int = 0  # general-path forwards through the prefill graphs (full or piecewise)
    sampler_graph_steps: int = 0  # general-path code sampling through the sampler graphs
    prepare_ms: float = 0.0
    forward_ms: float = 0.0
    output_ms: float = 0.0

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"prepare_ms": self.prepare_ms / n, "forward_ms": self.forward_ms / n, "output_ms": self.output_ms / n}
