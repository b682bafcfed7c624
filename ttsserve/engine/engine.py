"""The synchronous engine: add_request / abort / step. One step = schedule -> run the GPT -> sample ->
update the scheduler -> batched audio decode -> ordered audio outputs per synthesis request.

Thread-compatible, not thread-safe: AsyncEngine calls it from its one engine thread.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter

import numpy as np
import torch

from ttsserve.config import EngineConfig
from ttsserve.engine.audio_setup import build_audio_stage
from ttsserve.engine.batch_control import BatchSizeController
from ttsserve.engine.block_manager import KVCacheManager
from ttsserve.engine.deferred_capture import DeferredCapture
from ttsserve.engine.frontend import FrontEnd, Segment, check_room, prompt_items
from ttsserve.engine.registry import SequenceRegistry, SynthesisRecord, make_seq_id
from ttsserve.engine.request import Mode, Request
from ttsserve.engine.scheduler import Scheduler, SchedulerConfig
from ttsserve.engine.step_stats import EngineCounters, StepTimings, engine_stats, gc_pauses
from ttsserve.engine.synthesis import AudioOutput, SynthesisTracker
from ttsserve.model.chattts import ChatTTSModel, load_model, resolve_device
from ttsserve.params import SynthesisRequest
from ttsserve.runner.kernel_compiles import kernel_compiles
from ttsserve.runner.kv_cache import plan_engine_batch
from ttsserve.runner.model_runner import ModelRunner
from ttsserve.runner.step_types import RunnerOutput, SequenceInputs

logger = logging.getLogger(__name__)
# RequestUpdate / ScheduledRequest fields, read by C-level maps: the step's bookkeeping makes no Python call per row
_ID, _NUM_NEW, _FINISHED = attrgetter("request_id"), attrgetter("num_new_tokens"), attrgetter("finished")
_START, _PROMPT = attrgetter("num_computed_tokens"), attrgetter("num_prompt_tokens")
_NUM_STEPS = attrgetter("num_steps")


class Engine:
    def __init__(self, cfg: EngineConfig, model: ChatTTSModel | None = None) -> None:
        self.cfg = cfg
        self._threads = None  # runner/cpu_contention.py: the OpenMP team adapted to other work on its cores
        if resolve_device(cfg.device).type == "cpu":
            from ttsserve.runner.cpu_contention import ThreadMonitor
            from ttsserve.runner.cpu_threads import configure_cpu_threads

            policy = configure_cpu_threads(cfg.cpu_threads)  # threads = physical cores: oversubscribed teams stall
            self._threads = ThreadMonitor(policy.intra_op_threads, explicit=policy.source != "physical cores")
        self.model = model or load_model(cfg)
        tok = self.model.tokenizer
        self.frontend = FrontEnd(tok, self.model.gpt_config.num_vq)
        cfg, self.kv_spec = plan_engine_batch(cfg, self.model)
        self.cfg = cfg  # max_num_seqs resolved
        self.max_model_len = min(cfg.max_model_len, self.model.gpt_config.max_position_embeddings)
        burst = cfg.scheduler_steps(self.model.device.type)
        cuda_graphs = self.model.device.type == "cuda" and not cfg.enforce_eager
        defer = cuda_graphs and bool(cfg.background_graph_capture)  # engine/deferred_capture.py
        # before the runner: its start-up compiles are counted too
        self._compiles = kernel_compiles(install=self.model.device.type == "cuda")
        self._compiles.serving = False
        self.runner = ModelRunner(
            self.model,
            self.kv_spec,
            tok.spk_emb_id,
            tok.ebreak_id,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=cfg.enforce_eager,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_scheduler_steps=burst,
            defer_graph_capture=defer,
        )
        cadence, admission = cfg.step_intervals(self.model.device.type)
        self.pipelined = cfg.pipelined(self.model.device.type)
        self.runner.pipelined = self.pipelined
        self._in_flight: tuple | None = None  # (SchedulerOutput, launched step) whose results are not read yet
        self.kv_manager = KVCacheManager(
            self.kv_spec.num_blocks,
            cfg.block_size,
            self.kv_spec.num_cpu_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=min(cfg.max_num_seqs, cfg.max_num_batched_tokens),
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                max_model_len=self.max_model_len,
                preemption_mode=cfg.preemption_mode,
                admission_interval=admission,
                num_scheduler_steps=burst,
            ),
            self.kv_manager,
        )
        self.audio = build_audio_stage(cfg, self.model, cadence, cuda_graphs, defer)
        # A stream hears its first audio once its first chunk plus the right context exist.
        self.first_audio_frames = cfg.first_chunk_frames + self.audio.right_context_frames
        self.controller = BatchSizeController(cfg.target_step_latency_ms, self.scheduler.config.max_num_seqs)
        # every request's state, and the one path by which a sequence leaves every owner (engine/registry.py)
        self.registry = SequenceRegistry(self.scheduler, self.runner, self.audio)
        self.syntheses = self.registry.syntheses  # request_id -> SynthesisRecord
        self.sequences = self.registry.sequences  # SeqId -> SequenceRecord
        self.counters, self.timings, self._gc = EngineCounters(), StepTimings(), gc_pauses()
        self._ids = itertools.count()
        if cuda_graphs:
            self.warm_up()
        elif self.model.device.type == "cpu":
            from ttsserve.engine.warm_up import warm_up_cpu

            warm_up_cpu(self)
        families = self.runner.graph_families() + getattr(self.audio, "graph_families", list)()
        # the graphs' buckets left to capture between served steps (engine/deferred_capture.py)
        self.deferred = DeferredCapture(families, torch.cuda.synchronize) if defer else None
        logger.info(self.memory_report())
        if self._compiles.count:
            kc = self._compiles
            logger.info("start-up: %d Triton kernels compiled or loaded from cache in %.1f s", kc.count, kc.seconds)
        self._compiles.serving = True  # from here on a compile stalls a served step: logged as a warning

    def warm_up(self) -> None:
        """Serve a few synthetic requests to the end, then zero every counter (engine/warm_up.py)."""
        from ttsserve.engine.warm_up import warm_up

        warm_up(self)

    def reset_stats(self) -> None:
        """Zero every counter and timing of the engine and of the parts it owns (after warm-up)."""
        self.counters, self.timings = EngineCounters(), StepTimings()
        self.controller.reset()
        self.scheduler.reset_stats()
        self.runner.reset_stats()
        self.audio.reset_stats()

    # ---- memory ------------------------------------------------------------------------------------
    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until start-up work left to the background is done (False on timeout): the runner's CPU
        compilations; the deferred graph captures run here (by the engine's thread) unless timeout is 0."""
        if self.deferred is not None and timeout != 0 and not self.deferred.run_all(timeout):
            return False
        return self.runner.wait_warm(timeout) and not self.graphs_pending

    @property
    def graphs_pending(self) -> int:
        return 0 if self.deferred is None else self.deferred.num_pending

    def run_deferred(self, busy: bool) -> bool:
        """One deferred graph capture if due (between steps, on the engine's thread) -> whether one ran."""
        return self.deferred is not None and self.deferred.run_one(busy)

    def memory_report(self) -> str:
        """How many streams fit, and what weight / KV quantization saved (when used)."""
        from ttsserve.runner.memory_report import quantization_memory_report

        shares_budget = self.model.device.type == "cuda" and self.cfg.kv_cache_memory is None
        quant = quantization_memory_report(self.model, self.kv_spec, weights_share_budget=shares_budget)
        return self.kv_spec.report() + (f"; {quant}" if quant else "")

    # ---- requests ----------------------------------------------------------------------------------
    def add_synthesis(self, req: SynthesisRequest, segments: list[Segment] | None = None) -> str:
        """Admit one synthesis (ValueError for bad input, before anything is queued). segments: the
        request's text already through frontend.prepare_segments (an API server did it), else done here;
        a segment's code_ids (text/segments.tokenize_segments) are checked, then used instead of tokenizing."""
        rid = req.request_id or f"syn-{next(self._ids)}"
        if rid in self.syntheses:
            raise ValueError(f"request_id {rid!r} is already in use")
        if segments is None:
            segments = self.frontend.segments(req)
        elif not segments or [s.index for s in segments] != list(range(len(segments))):
            raise ValueError("segments must be numbered 0..n-1, at least one")
        else:
            self.frontend.check_code_ids(req, segments, self.max_model_len)
        seed = req.code_params.seed if req.code_params.seed is not None else random.getrandbits(62)
        dropped = sorted({c for s in segments for c in s.dropped})
        syn = SynthesisRecord(
            rid, req, SynthesisTracker(rid, len(segments), dropped, [s.text for s in segments]), seed, segments
        )
        syn.prefix_key = req.voice.key + req.code_prompt
        spk = req.voice.spk_emb
        syn.spk_emb = None if spk is None else torch.as_tensor(np.asarray(spk, dtype=np.float16))
        self.registry.add_synthesis(syn)
        try:
            for seg in segments:
                if req.refine_text:
                    ids, mask = self.frontend.refine_inputs(seg.text, req.refine_prompt)
                    self._add_sequence(syn, seg.index, "text", ids, mask)
                else:
                    self._add_code_sequence(syn, seg.index, seg.text, seg.code_ids)
        except BaseException:
            # a later segment was refused: the earlier ones must not stay behind without a consumer
            self.registry.release_synthesis(syn)
            raise
        return rid

    def _add_code_sequence(self, syn: SynthesisRecord, seg: int, text: str, code_ids: np.ndarray | None = None) -> None:
        ids, mask = self.frontend.code_inputs(text, syn.req.code_prompt, syn.req.voice, code_ids)
        self._add_sequence(syn, seg, "code", ids, mask)

    def _add_sequence(self, syn: SynthesisRecord, seg: int, mode: Mode, ids: torch.Tensor, mask: torch.Tensor) -> None:
        params = syn.req.code_params if mode == "code" else syn.req.refine_params
        # The seed schedule: segment k of a request uses seed + k, so a long text is reproducible.
        seed = (syn.seed + seg + (0 if mode == "code" else 1 << 40)) % (1 << 62)
        room = check_room(seg, ids.shape[0], self.max_model_len)
        req = Request(
            make_seq_id(syn.request_id, seg, mode),
            prompt_items(ids.numpy(), mask.numpy()),
            mode=mode,
            max_new_tokens=min(params.max_new_tokens, room),
            prefix_key=syn.prefix_key,
            first_audio_frames=self.first_audio_frames if mode == "code" else 0,
        )
        self.registry.add_sequence(syn, seg, req, SequenceInputs(ids, mask, syn.spk_emb, mode, params, seed))

    def abort(self, rid: str) -> None:
        """Abort a synthesis: its sequences leave the batch and free their blocks at the next step."""
        syn = self.syntheses.get(rid)
        if syn is not None:
            self.registry.release_synthesis(syn)

    def fail_all(self, message: str) -> list[AudioOutput]:
        """Abort every synthesis (after a failed step) -> one final error output each."""
        outputs = []
        for syn in list(self.syntheses.values()):
            self.registry.release_synthesis(syn)
            outputs.append(
                AudioOutput(syn.request_id, np.zeros(0, np.float32), True, finish_reason="error", error=message)
            )
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.syntheses)

    @property
    def num_syntheses(self) -> int:
        """Syntheses admitted and not finished (the queue bound counts these)."""
        return len(self.syntheses)

    def has_synthesis(self, rid: str) -> bool:
        return rid in self.syntheses

    # ---- the step ----------------------------------------------------------------------------------
    def step(self, emit: Callable[[list[AudioOutput]], None] | None = None) -> list[AudioOutput]:
        """One engine step. On CUDA the GPT step is queued first, then the vocoder's host work runs while the
        device computes (its kernels queue behind the step), then the step's one sync. Pipelined
        (async_scheduling), the step queued here is the next one: this call then reads the results of the
        step queued by the previous call while the device already runs this one, and queues the vocoder
        after that read, so the frames it brought are decoded in this call, not the next (a step sooner).
        emit: called in mid-step with the outputs of the last call's vocoder if the device has finished it by
        then (poll_audio), so they can leave before this step's end; the rest are returned."""
        tm, clock = self.timings, time.perf_counter
        t0, pauses = clock(), (self._gc.total_s(), self._compiles.seconds)
        if self._threads is not None:
            self._threads.tick()
        vocoder0 = (self.audio.calls_total, self.audio.frames_decoded_total)
        self.scheduler.max_num_seqs_limit = self.controller.limit
        failed = self.registry.num_failed
        sched = self.scheduler.schedule()
        self._handle_scheduler_finished(sched)
        self._observe_queue_times(sched)
        self.counters.preemptions += len(sched.preempted_ids)
        self.counters.swaps += len(sched.swapped_out_ids)
        t1 = clock()
        launched = self.runner.launch(sched, self.scheduler.requests)
        t2 = clock()
        if emit is not None and (early := self.poll_audio()):
            emit(early)
        chunks = self.audio.step() if self.audio.deferred and not self.pipelined else None
        t3 = clock()
        if self.pipelined:
            done, self._in_flight = self._in_flight, (sched, launched) if launched is not None else None
        else:
            done = (sched, launched)
        out = self.runner.wait(done[1]) if done else RunnerOutput()
        t4 = clock()
        updates = self.scheduler.update_from_output(done[0], out.sampled, out.stopped) if done else []
        if self.registry.num_failed != failed and updates:
            # a synthesis failed in this step: the scheduler drops its sequences at its next schedule(), their
            # results of a step already in flight are void
            updates = [u for u in updates if u.request_id in self.sequences]
        t5 = clock()
        if out.frames:
            self._append_frames(out.frames, updates, out.done)
        t6 = clock()
        for u in compress(updates, map(_FINISHED, updates)):
            self._finish_sequence(u.request_id, u.finish_reason or "stop")
        t7 = clock()
        if chunks is None:
            chunks = self.audio.step()
        t8 = clock()
        outputs = self._collect_audio(chunks)
        t9 = clock()
        phases = {
            "schedule_ms": t1 - t0,
            "runner_ms": t2 - t1 + t4 - t3,
            "update_ms": t5 - t4,
            "audio_append_ms": t6 - t5,
            "finish_ms": t7 - t6,
            "audio_step_ms": t3 - t2 + t8 - t7,
            "outputs_ms": t9 - t8,
        }
        for name, dt in phases.items():
            setattr(tm, name, getattr(tm, name) + dt * 1e3)
        vocoder = (self.audio.calls_total - vocoder0[0], self.audio.frames_decoded_total - vocoder0[1])
        self._account(t0, sched, phases, pauses, vocoder)
        return outputs

    def poll_audio(self) -> list[AudioOutput]:
        """The outputs of the vocoder call in flight if the device has finished it (never waits; step() polls
        in mid-step for its emit, and a caller may poll between steps)."""
        chunks = self.audio.poll()  # [] unless a deferred call is in flight and done
        return self._collect_audio(chunks) if chunks else []

    def _append_frames(self, frames: list, updates: list, done=None) -> None:
        """The hidden states of accepted frames into the audio stage (RunnerOutput.frames batches [m, n, H]): of a
        request's m frames, as many as its update appended (RequestUpdate.num_new_tokens). Fewer: a burst cut by
        EOS or max_new_tokens; none: a pipelined step's row whose results the scheduler dropped (EOS, abort or
        preemption while in flight). One append per batch: the audio stage keeps the counts' frames. A
        segment's frame count is its sequence's outputs, taken when it leaves (SequenceRegistry.release).
        done: the step's completion event (RunnerOutput.done), which an audio stage on its own stream waits on."""
        get = dict(zip(map(_ID, updates), map(_NUM_NEW, updates))).get
        for seq_ids, hiddens in frames:
            m, counts = hiddens.shape[0], np.fromiter(map(get, seq_ids, repeat(0)), np.int64, len(seq_ids))
            self.audio.append_batch(seq_ids, hiddens, None if counts.min(initial=m) >= m else counts, done)
            self.counters.frames += int(counts.sum())

    def _account(self, t0: float, sched, phases: dict[str, float], pauses: tuple, vocoder: tuple[int, int]) -> None:
        """pauses: (GC seconds, Triton compile seconds) of the process at the step's start."""
        ms = (time.perf_counter() - t0) * 1e3
        gc_ms, compile_ms = (self._gc.total_s() - pauses[0]) * 1e3, (self._compiles.seconds - pauses[1]) * 1e3
        n, tokens = len(sched.scheduled), sched.num_scheduled_tokens
        self.counters.observe_step(ms, phases, n, tokens, gc_ms, vocoder, compile_ms)
        if sched.scheduled and self.controller.enabled:  # the goal is per frame: a burst makes num_steps each
            self.controller.observe(len(sched.scheduled), ms / max(map(_NUM_STEPS, sched.scheduled)))

    def _handle_scheduler_finished(self, sched) -> None:
        """Requests the scheduler ended on its own (impossible to serve) fail their synthesis; the ids of
        sequences the engine released come back here too, and are gone from the registry. The failed
        syntheses' other sequences may be in this step's batch: they leave it (the runner forgot them)."""
        failed = False
        for sid in sched.finished_ids:
            rec = self.sequences.get(sid)
            if rec is not None and rec.request.error:
                self.registry.fail(rec.synthesis, f"segment {rec.segment}: {rec.request.error}")
                failed = True
        if failed:
            sched.retain(self.sequences)

    def _finish_sequence(self, sid: str, reason: str) -> None:
        rec = self.sequences.get(sid)
        if rec is None:  # released earlier in this loop: a sibling's refine -> code hand-off failed
            return
        if rec.mode == "text":
            # Refine finished: hand the refined text to the code stage of the same segment.
            syn, seg = rec.synthesis, rec.segment
            text = self.frontend.decode_refined(list(rec.request.output_token_ids))
            self.registry.release(rec)
            try:
                self._add_code_sequence(syn, seg, text or syn.segments[seg].text)
            except ValueError as e:  # the refined prompt is too long: fail this synthesis, not the step
                self.registry.fail(syn, f"segment {seg}: {e}")
            return
        # the segment ends with its final audio chunk, which may leave the (deferred) audio stage later
        self.registry.end_generation(rec, reason)

    def _observe_queue_times(self, sched) -> None:
        """A synthesis waits in the queue from its arrival to the first step that schedules one of its sequences."""
        now, scheduled = None, sched.scheduled
        # only prefill rows (a decode row was scheduled before): picked by C-level maps
        for s in compress(scheduled, map(int.__lt__, map(_START, scheduled), map(_PROMPT, scheduled))):
            rec = self.sequences.get(s.request_id)
            if rec is None or rec.synthesis.scheduled:
                continue
            rec.synthesis.scheduled = True
            now = now or time.monotonic()
            self.counters.queue_time.observe(now - rec.synthesis.arrived)

    def _collect_audio(self, chunks: list) -> list[AudioOutput]:
        touched: dict[str, SynthesisRecord] = {}
        sequences = self.sequences
        for chunk in chunks:
            rec = sequences.get(chunk.req_id)
            if rec is None:  # released (its synthesis aborted or failed) while this chunk was in flight
                continue
            syn = rec.synthesis
            syn.tracker.add_audio(rec.segment, chunk.samples)
            if chunk.is_final and rec.finishing is not None:
                syn.tracker.finish_segment(rec.segment, rec.finishing)
                self.registry.release(rec)
            touched[syn.request_id] = syn
        for syn in self.registry.take_failed():
            touched[syn.request_id] = syn
        outputs: list[AudioOutput] = []
        for syn in touched.values():
            drained = syn.tracker.drain()
            if not syn.heard and any(o.samples.size for o in drained):
                syn.heard = True
                self.counters.first_audio.observe(time.monotonic() - syn.arrived)
            outputs.extend(drained)
            if syn.tracker.done:
                self.registry.release_synthesis(syn)
        return outputs

    def stats(self) -> dict:
        return engine_stats(self)
