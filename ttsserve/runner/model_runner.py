"""ModelRunner: packs one step's scheduled requests into flat inputs, runs the GPT through paged attention,
applies the heads and the batched sampler, and returns sampled rows plus the hidden states the vocoder needs.

Two paths, one result:
- decode steps (every scheduled sequence is a code request advancing by the one frame it sampled last step):
  the input frames, sampling parameters and repetition history are already on the device (SamplingState,
  indexed by the sequence's row), so a step is a small host pack plus, on CUDA, one CUDA-graph replay
  (runner/cuda_graphs.py) and one device-to-host copy of the sampled codes; a decode burst (multi-step
  scheduling) replays the graph num_steps times in a row, each replay reading the frame the last one sampled;
- any other step (prefill, chunked prefill, recompute, refine-text): vectorised inputs, and on CUDA the GPT
  through one graph per token bucket, the attention in it (runner/prefill_graphs.py); a mixed step replays
  the decode graph for its decode rows and runs the rest that way.
The runner never touches a queue; the scheduler never touches a tensor (docs/ARCHITECTURE.md, "Who owns what").
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ttsserve.attention.backend import AttentionMetadata, PagedAttention, runner_backend
from ttsserve.h2d import async_h2d
from ttsserve.layers.quant.linear import precompile_quant_linears
from ttsserve.model.chattts import ChatTTSModel
from ttsserve.runner.input_batch import InputBatch, ScheduledColumns, StepArrays
from ttsserve.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from ttsserve.runner.runner_setup import build_cuda_graphs, setup_cpu
from ttsserve.runner.step_inputs import gather_input_rows
from ttsserve.runner.step_outputs import runner_output
from ttsserve.runner.step_types import (
    LaunchedStep,
    RunnerOutput,
    RunnerTimings,
    SequenceInputs,
    SequenceState,
    StepGroup,
)
from ttsserve.sample.sampler import sample, sample_and_record
from ttsserve.sample.state import SamplingState

DEFAULT_HISTORY_WINDOW = 16
_MAX_SPEAKERS = 256  # normalized speaker vectors kept (fp32 [768]: 3 KB each)


def _pick(items: list, idx) -> list:
    """items[i] for i in idx (an int array or list), by a C-level map."""
    return list(map(items.__getitem__, idx.tolist() if isinstance(idx, np.ndarray) else idx))


class ModelRunner:
    """max_num_seqs: rows of the persistent batch (grows if exceeded); max_model_len: positions per sequence
    (sizes the block tables and the graphs' attention split); enforce_eager: no CUDA graphs;
    defer_graph_capture: capture each graph family's largest and smallest buckets only, the others later through
    graph_families() (engine/deferred_capture.py)."""

    def __init__(
        self,
        model: ChatTTSModel,
        kv_spec: KVCacheSpec,
        spk_emb_id: int,
        text_eos_id: int,
        *,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        capture_sizes: list[int] | None = None,
        max_num_batched_tokens: int = 4096,
        num_scheduler_steps: int = 1,
        defer_graph_capture: bool = False,
    ) -> None:
        defer = defer_graph_capture
        self.model = model
        self.device, self.dtype = model.device, model.dtype
        self.cfg = model.gpt_config
        kv = allocate_kv_cache(self.cfg, kv_spec, self.device, self.dtype)  # on CUDA: on a helper thread
        self.kv = None if self.device.type == "cuda" else kv.result()
        self.block_size = kv_spec.block_size
        self.backend, graphable = runner_backend(self.device, self.cfg.head_dim)
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        self.cpu_graph = None
        self.cpu_fused = None  # runner/cpu_decode.py: the eager decode step through the fused CPU kernels
        if self.device.type == "cpu":
            setup_cpu(self, enforce_eager)
        self.spk_emb_id, self.text_eos_id = spk_emb_id, text_eos_id
        self.max_model_len = min(max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(
            max_num_seqs, max_blocks, self.block_size, self.device, max_num_steps=num_scheduler_steps
        )
        self.sampling = SamplingState(max_num_seqs, self.cfg.num_vq, DEFAULT_HISTORY_WINDOW, self.device)
        self.states: dict[str, SequenceState] = {}
        self._speakers: dict[tuple, torch.Tensor] = {}  # (dtype, bytes of spk_emb) -> normalized vector
        self.timings = RunnerTimings()
        # Pipelined (the engine's async_scheduling): decode rows may continue from a token the host has not
        # seen yet, so they always take the decode path (which reads last_tokens on the device), and a
        # step's outputs must survive the next step being queued before they are read.
        self.pipelined = False
        self.graphs = None
        self.prefill_graphs = None  # runner/prefill_graphs.py: the general path's forward, by token bucket
        self.sampler_graphs = None  # runner/sampler_graphs.py: the general path's code sampling, by row bucket
        if self.device.type == "cuda" and not enforce_eager and graphable:
            build_cuda_graphs(self, kv, capture_sizes, max_num_seqs, max_num_batched_tokens, num_scheduler_steps, defer)
        self.kv = self.kv or kv.result()
        if self.backend.name == "triton":  # its eager decode variants, compiled before the engine is ready
            self.backend.precompile_decode(self.kv.layers[0], self.cfg.num_heads, self.dtype)
        if self.device.type == "cuda":  # and the quantized linears' launch shapes, for any step's rows
            precompile_quant_linears(self.model.gpt, max(max_num_batched_tokens, max_num_seqs), self.dtype)

    def graph_families(self) -> list:
        """The CUDA graph families, in the order their deferred buckets pay: every decode step replays one."""
        return [g for g in (self.graphs, self.sampler_graphs, self.prefill_graphs) if g is not None]

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until start-up work left to the background (the CPU compilations) is done."""
        if self.device.type != "cpu":
            return True
        if not self.backend.wait_compiled(timeout):
            return False
        return self.cpu_graph is None or self.cpu_graph.wait(timeout)

    # ---- per-request state -------------------------------------------------------------------------------
    def add_sequence(self, req_id: str, inputs: SequenceInputs) -> None:
        """Register a sequence's prompt (host arrays only: it is embedded by the steps that feed it)."""
        q = self.cfg.num_vq
        if inputs.ids.dim() != 2 or inputs.ids.shape[1] != q:
            raise ValueError(f"ids must be [T, {q}], got {tuple(inputs.ids.shape)}")
        if inputs.text_mask.shape != inputs.ids.shape[:1]:
            raise ValueError(f"text_mask must be [{inputs.ids.shape[0]}], got {tuple(inputs.text_mask.shape)}")
        ids = inputs.ids.numpy().astype(np.int64, copy=False)
        mask = inputs.text_mask.numpy().astype(bool, copy=False)
        spk, spk_rows = None, np.empty(0, dtype=np.int64)
        if inputs.spk_emb is not None:
            spk = self._speaker(inputs.spk_emb.cpu())
            spk_rows = np.flatnonzero(ids[:, 0] == self.spk_emb_id)
        if inputs.params.repetition_window > self.sampling.window:
            self.sampling.grow(window=inputs.params.repetition_window)  # graphs re-capture on next use
        self.states[req_id] = SequenceState(ids, mask, spk, spk_rows, inputs.mode, inputs.params, inputs.seed)

    def _speaker(self, spk_emb: torch.Tensor) -> torch.Tensor:
        """The normalized speaker vector of spk_emb [H] (host), shared read-only by every sequence of that vector: a
        served voice repeats across requests, and normalizing it (torch ops on the step thread) costs more than the
        lookup. The cache is bounded: a server of many voices clears it now and then."""
        key = (spk_emb.dtype, spk_emb.contiguous().view(torch.uint8).numpy().tobytes())
        spk = self._speakers.get(key)
        if spk is None:
            if len(self._speakers) >= _MAX_SPEAKERS:
                self._speakers.clear()
            spk = self._speakers[key] = self.model.embed.normalize_speaker(spk_emb)
        return spk

    def remove_sequence(self, req_id: str) -> None:
        """Forget a sequence (its batch row and prompt state); an unknown id is ignored."""
        self.states.pop(req_id, None)
        self.input_batch.release(req_id)

    def reset_stats(self) -> None:
        self.timings = RunnerTimings()

    @property
    def generation(self) -> tuple[int, int, int]:
        """Changes whenever a tensor that graphs capture is reallocated."""
        return self.input_batch.generation, self.sampling.num_rows, self.sampling.window

    # ---- one step ----------------------------------------------------------------------------------------
    def execute(self, sched, requests: dict) -> RunnerOutput:
        """sched: a SchedulerOutput; requests: req_id -> Request (for output_token_ids)."""
        return self.wait(self.launch(sched, requests))

    @torch.inference_mode()
    def launch(self, sched, requests: dict) -> LaunchedStep | None:
        """Queue one step on the device (the forward, the sampler and the copy of the sampled tokens to the
        host) without waiting for it; `wait()` returns its RunnerOutput. The caller may queue other device
        work in between (the vocoder): it runs after this step and does not delay wait()."""
        t0 = time.perf_counter()
        self.kv.swap_out(sched.swap_out)
        self.kv.swap_in(sched.swap_in)
        for req_id in sched.preempted_ids:
            self.input_batch.release(req_id)  # a resumed sequence re-initialises its row from host state
        scheduled = sched.scheduled
        if not scheduled:
            return None
        cols = self._update_states(scheduled, sched.num_scheduled_tokens, requests)
        tm = self.timings
        tm.steps += 1
        decode = np.flatnonzero(cols.decode)
        bursts = np.unique(cols.num_steps[decode]).tolist()  # ascending
        if len(decode) == len(scheduled) and len(bursts) == 1:
            groups = [self._decode_group(cols, None, bursts[0])]
        elif bursts and (
            self.pipelined or bursts[-1] > 1 or self.graphs is not None and self.graphs.can_run(len(decode))
        ):
            # A mixed step: the decode rows replay their graph, the prefill / text rows run after it on the
            # general path. Off CUDA one forward over all rows reads the weights once, which is what a CPU
            # step is bound by; but pipelined, the decode rows' inputs may be on the device only, which
            # only the decode path reads (as a burst's are).
            groups = [self._decode_group(cols, decode[cols.num_steps[decode] == k], k) for k in reversed(bursts)]
            rest = np.flatnonzero(~cols.decode)
            if len(rest):
                groups += self._execute_general(scheduled, cols, rest, requests)
            tm.mixed_graph_steps += self.graphs is not None and bool(len(rest))
        else:
            groups = self._execute_general(scheduled, cols, None, requests)
        # no group where every row is a prompt chunk before its last (nothing samples): an empty read-back
        flat = [g.tokens.reshape(-1) for g in groups] or [torch.zeros(0, dtype=torch.int64, device=self.device)]
        flat = torch.cat(flat) if len(flat) > 1 else flat[0]
        event = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # pipelined, the next step (queued before this one is read) may rewrite a static buffer viewed here
            host = flat.clone() if self.pipelined else flat
        tm.prepare_ms += (time.perf_counter() - t0) * 1e3
        return LaunchedStep(groups, host, event)

    def _decode_group(self, cols: ScheduledColumns, idx: np.ndarray | None, num_steps: int = 1) -> StepGroup:
        """Code decode rows cols[idx] (all rows when idx is None; num_steps new frames each, past the prompt):
        graph replays where one fits, else eager; each of the num_steps steps reads the frame the previous
        one sampled (on the device)."""
        rows, starts, steps = cols.rows, cols.starts, cols.steps
        ids = cols.req_ids
        if idx is not None:
            rows, starts, steps, ids = rows[idx], starts[idx], steps[idx], _pick(ids, idx)
        if self.graphs is not None and self.graphs.can_run(len(rows)):
            tokens, hidden = self.graphs.run(rows, starts, steps, num_steps)
            if num_steps == 1:
                # a view of the graph's output, which the next replay rewrites; its reader (the audio stage, maybe
                # on a CUDA stream of its own) may read it after that
                hidden = hidden.clone()
            self.timings.graph_steps += 1
        else:
            outs = [self._decode_eager(rows, starts + j, steps + j) for j in range(num_steps)]
            tokens, hidden = torch.stack([t for t, _ in outs], dim=1), torch.stack([h for _, h in outs])
        return StepGroup("code", ids, tokens, hidden, num_steps)

    def wait(self, launched: LaunchedStep | None) -> RunnerOutput:
        """The sampled tokens of a launched step (the one device-to-host sync of the step)."""
        if launched is None:
            return RunnerOutput()
        t0 = time.perf_counter()
        if launched.event is not None:
            launched.event.synchronize()
        t1 = time.perf_counter()
        # one bulk copy out of the pinned buffer, then element reads (tolist) from ordinary memory: in a
        # profile of the served core on the H200's VM, reading the pinned array element by element took ~10x
        # what it takes here (runner_output's tolist line 5.3% of the core's samples, 0.5 ms a step);
        # the copy's effect there has not been measured
        out = runner_output(launched.groups, launched.host.numpy().copy(), self.cfg.audio_eos_id, self.text_eos_id)
        out.done = launched.event
        self.timings.forward_ms += (t1 - t0) * 1e3
        self.timings.output_ms += (time.perf_counter() - t1) * 1e3
        return out

    def _update_states(self, scheduled: list, num_tokens: int, requests: dict) -> ScheduledColumns:
        """The step's columns (InputBatch.update_states), after initialising the sampling state of the rows
        of sequences new to the batch."""
        cols, new = self.input_batch.update_states(scheduled, num_tokens)
        if self.input_batch.max_rows > self.sampling.num_rows:
            self.sampling.grow(num_rows=self.input_batch.max_rows)
        if new:
            new_ids = _pick(cols.req_ids, new)
            sts = [self.states[r] for r in new_ids]
            self.sampling.set_rows(
                cols.rows[new].tolist(),
                [st.params for st in sts],
                [st.seed for st in sts],
                [st.mode for st in sts],
                [requests[r].output_token_ids for r in new_ids],
            )
        return cols

    def _metadata(self, arr: StepArrays) -> tuple[AttentionMetadata, torch.Tensor]:
        """AttentionMetadata and positions [T] on the device for one step's host arrays."""
        ib = self.input_batch
        if self.device.type == "cpu":  # the host table is the table: one numpy gather, no torch op
            tables = torch.from_numpy(ib.block_table_np[arr.rows])
        else:
            tables = ib.block_table[async_h2d(torch.from_numpy(arr.rows), self.device)]
        md = AttentionMetadata(
            cu_seqlens_q=async_h2d(torch.from_numpy(arr.cu_seqlens_q), self.device),
            seq_lens=async_h2d(torch.from_numpy(arr.seq_lens), self.device),
            block_tables=tables,
            slot_mapping=async_h2d(torch.from_numpy(arr.slot_mapping), self.device),
            max_query_len=int(arr.num_new.max()),
            max_seq_len=int(arr.seq_lens.max()),
            block_size=self.block_size,
            cu_seqlens_q_cpu=arr.cu_seqlens_q.tolist(),
            seq_lens_cpu=arr.seq_lens.tolist(),
        )
        return md, async_h2d(torch.from_numpy(arr.positions), self.device)

    def _forward(self, x: torch.Tensor, md: AttentionMetadata, positions: torch.Tensor) -> torch.Tensor:
        return self.model.gpt(x, positions, PagedAttention(self.backend, self.kv.layers, md, self.scale))

    def _forward_general(self, x: torch.Tensor, md: AttentionMetadata, positions: torch.Tensor) -> torch.Tensor:
        """The general path's forward: the prefill graphs where they are captured (the compiled fused ops run
        eagerly cost more host time than GPT.forward: 3.8 -> 6.2 ms per step on an H200, docs/benchmarks-history.md)."""
        pg = self.prefill_graphs
        if pg is None or not pg.can_run(x.shape[0], md.num_seqs):
            return self._forward(x, md, positions)
        self.timings.prefill_graph_steps += 1
        return pg.run(x, positions, PagedAttention(self.backend, self.kv.layers, md, self.scale))

    def _decode_eager(self, rows: np.ndarray, starts: np.ndarray, steps: np.ndarray):
        arr = self.input_batch.step_arrays(rows, starts, np.ones_like(starts), steps)
        md, positions = self._metadata(arr)
        rows_t = async_h2d(torch.from_numpy(rows), self.device)
        x = self.model.embed.embed_codes(self.sampling.last_tokens[rows_t])
        hidden = None if self.cpu_graph is None else self.cpu_graph.run(x, positions, md)
        if hidden is None and self.cpu_fused is not None:
            hidden = self.cpu_fused.run(x, positions, md)
        hidden = (self._forward(x, md, positions) if hidden is None else hidden).float()
        return self.sample_rows(hidden, rows_t, async_h2d(torch.from_numpy(steps), self.device), "code"), hidden

    def sample_rows(
        self, hidden: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor, mode: str, ops=None
    ) -> torch.Tensor:
        """Heads + sampler for hidden [B, H] fp32 of `rows` at `steps`; records the tokens in the rows'
        histories. Returns [B, num_vq] (code) or [B, 1] (text) int64 on the device. Graph-capturable.
        ops: DecodeOps, whose sample_record runs (the Triton sampler: one kernel); None: sampler.sample."""
        embed = self.model.embed
        if mode == "code":
            logits, eos = embed.code_logits(hidden), self.cfg.audio_eos_id
        else:
            logits, eos = embed.text_logits(hidden)[:, None, :], self.text_eos_id
        if ops is not None:
            return ops.sample_record(logits, self.sampling, rows, steps, eos)
        return sample_and_record(sample, logits, self.sampling, rows, steps, eos)

    def _execute_general(self, scheduled: list, cols: ScheduledColumns, idx: np.ndarray | None, requests: dict) -> list:
        """Rows cols[idx] (all rows when idx is None) through the general path: vectorised inputs, one forward,
        then the heads and sampler of the rows that sample, one group per mode."""
        rows, starts, num_new, steps, ids = cols.rows, cols.starts, cols.num_new, cols.steps, cols.req_ids
        code, will_sample = cols.code, cols.will_sample
        if idx is not None:
            scheduled = _pick(scheduled, idx)
            rows, starts, num_new, steps, ids = rows[idx], starts[idx], num_new[idx], steps[idx], _pick(ids, idx)
            code, will_sample = code[idx], will_sample[idx]
        arr = self.input_batch.step_arrays(rows, starts, num_new, steps)
        md, positions = self._metadata(arr)
        x = self._gather_inputs(scheduled, arr, requests)
        hidden = self._forward_general(x, md, positions)
        groups = []
        for mode, of_mode in (("code", code), ("text", ~code)):
            sel = np.flatnonzero(will_sample & of_mode)
            if not len(sel):
                continue
            last = async_h2d(torch.from_numpy(arr.cu_seqlens_q[sel + 1].astype(np.int64) - 1), self.device)
            h = hidden[last].float()
            sg = self.sampler_graphs
            if mode == "code" and sg is not None and sg.can_run(len(sel)):
                tokens = sg.run(h, rows[sel], steps[sel])
                self.timings.sampler_graph_steps += 1
            else:
                rows_t = async_h2d(torch.from_numpy(rows[sel]), self.device)
                tokens = self.sample_rows(h, rows_t, async_h2d(torch.from_numpy(steps[sel]), self.device), mode)
            groups.append(StepGroup(mode, _pick(ids, sel), tokens[:, None], h[None] if mode == "code" else None))
        return groups

    def _gather_inputs(self, scheduled: list, arr: StepArrays, requests: dict) -> torch.Tensor:
        """[T, H] step inputs in the GPT dtype: every row's prompt id or earlier output (runner/step_inputs.py),
        embedded in one call per table (text, codes), then the speaker rows; the indices in one copy."""
        rows = gather_input_rows(scheduled, arr.cu_seqlens_q, self.states, requests, self.cfg.num_vq)
        flat = async_h2d(torch.from_numpy(rows.flat), self.device)
        t_ids, t_dst, c_ids, c_dst, s_dst = flat.split(rows.split_sizes(self.cfg.num_vq))
        embed, n_code = self.model.embed, rows.num_code
        x = torch.empty(rows.num_rows, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        if rows.num_text:
            x[t_dst] = embed.embed_text(t_ids).to(self.dtype)
        if n_code:
            x[c_dst] = embed.embed_codes(c_ids.view(n_code, self.cfg.num_vq)).to(self.dtype)
        if rows.spk_vecs:  # after the text rows: the speaker replaces its [spk_emb] position's text embedding
            x[s_dst] = async_h2d(torch.stack(rows.spk_vecs), self.device).to(self.dtype)
        return x
