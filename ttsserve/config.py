"""ModelConfig: every size read from the checkpoint (never hard-coded); the CPU compile level ($TTSSERVE_CPU_COMPILE)
and the CUDA decode ops ($TTSSERVE_DECODE_OPS), read here because the launcher checks them before it imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

# "1": torch.compile the CPU decode attention, then the whole decode step (runner/cpu_graph.py); "attention":
# the attention only; "0" / unset: neither
COMPILE_ENV = "TTSSERVE_CPU_COMPILE"
COMPILE_LEVELS = ("0", "attention", "1")


def compile_level() -> str:
    """$TTSSERVE_CPU_COMPILE, checked: one of COMPILE_LEVELS (ValueError otherwise)."""
    level = os.environ.get(COMPILE_ENV, "0")
    if level not in COMPILE_LEVELS:
        raise ValueError(f"${COMPILE_ENV} must be one of {', '.join(COMPILE_LEVELS)}, got {level!r}")
    return level


# $TTSSERVE_DECODE_OPS on CUDA: "triton" (the default): the norms, SiLU-and-mul and RoPE as hand-written Triton
# kernels (layers/triton_fused.py) and the code sampler as one Triton kernel (sample/triton_sampler.py): nothing
# torch.compile'd (on an H100 9.3-13.2 s to /ready, caches warm); "triton-compiled-sampler": the sampler
# torch.compile'd instead (as fast within 0.1 ms a step at 256 / 512 rows: benchmarks/sampler_micro.py; 13 s more
# start); "triton-eager-sampler": the sampler op by op; "compile": every op torch.compile'd.
DECODE_OPS_ENV = "TTSSERVE_DECODE_OPS"
DECODE_OPS_MODES = ("triton", "triton-compiled-sampler", "triton-eager-sampler", "compile")


def decode_ops_mode() -> str:
    """$TTSSERVE_DECODE_OPS, checked: one of DECODE_OPS_MODES (ValueError otherwise)."""
    mode = os.environ.get(DECODE_OPS_ENV, "triton")
    if mode not in DECODE_OPS_MODES:
        raise ValueError(f"${DECODE_OPS_ENV} must be one of {', '.join(DECODE_OPS_MODES)}, got {mode!r}")
    return mode


DECODE_GEMV_ENV = "TTSSERVE_DECODE_GEMV"


def decode_gemv() -> bool:
    """$TTSSERVE_DECODE_GEMV: "1" or unset runs the one-row decode graph's GPT through layers/triton_gemv.py (5
    kernels a layer instead of 9; dense weights only: one 10-s utterance 0.30 s instead of 0.39 on an H100,
    BENCHMARKS.md), "0" keeps the GEMM path (ValueError for anything else)."""
    value = os.environ.get(DECODE_GEMV_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"${DECODE_GEMV_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass(frozen=True)
class GPTConfig:
    """The Llama body plus ChatTTS's vocabularies (MODEL.md §1.3). head_dim = hidden_size / num_heads."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    num_text_tokens: int = 21178
    num_audio_tokens: int = 626
    num_vq: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def audio_eos_id(self) -> int:
        return self.num_audio_tokens - 1

    @classmethod
    def from_hf_json(cls, cfg: dict) -> GPTConfig:
        """Build from `asset/gpt/config.json` (an HF LlamaConfig with ChatTTS extras)."""
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                num_text_tokens=int(cfg.get("num_text_tokens", 21178)),
                num_audio_tokens=int(cfg.get("num_audio_tokens", 626)),
                num_vq=int(cfg.get("num_vq", 4)),
            )
        except KeyError as e:
            raise ValueError(f"asset/gpt/config.json: missing key {e.args[0]!r}") from None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one position (one frame)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass
class EngineConfig:
    """Every engine knob (one flat, validated dataclass; each is also a CLI flag and a TTSSERVE_* env var).

    model: a checkpoint folder / hub id, or None to search ($TTSSERVE_MODEL, ./asset, the hub cache).
    load_format: "auto" (a checkpoint if found, else dummy with a loud warning), "safetensors", "dummy".
    dummy_size: "real" or "tiny" (random weights at the real ChatTTS size, or the test size).
    kv_cache_memory: bytes for the KV pool on CPU (and on GPU when set; otherwise sized from
        gpu_memory_utilization after profiling).
    swap_space: GiB of host memory for swapped-out KV blocks.
    target_step_latency_ms: the dynamic-batching goal; 0 disables the controller.
    first_chunk_frames / max_chunk_frames: streaming chunk sizes (the first is small for a low time to first
        audio; later ones double up to the max).
    lookahead_frames: right context of each streamed window; None = exact (the stitched stream equals the
        one-shot decode); smaller values start audio sooner at the cost of small seams (see docs/benchmarks-history.md).
    first_chunk_lookahead_frames: with the exact vocoder, a stream's first audio leaves once it has this many
        frames of right context, in early chunks (to frames 8 and 24) decoded from its first frames alone
        (audio/first_chunk.py: within 7e-6 of exact at 16), every later sample exact; None: all exact.
    vocoder_cadence: the exact (incremental) vocoder runs on every k-th engine step only, for every stream
        that is due by then: streams that arrived at different times share calls (at most k - 1 steps later).
    admission_interval: while streams run, new requests start (prefill) on every k-th step only, together.
        Both None: 8 frames on CUDA (where a call or a prefill costs several decode steps of host time; 8 beat 4
        and 1 on the H200, docs/benchmarks-history.md), i.e. 8 // num_scheduler_steps steps; 1 on the CPU.
    num_scheduler_steps: decode bursts (multi-step scheduling, engine/scheduler.py): each schedule() runs a code
        stream's next k decode steps on the device in a row (each step's input is the frame the last one
        sampled), so the host's per-step work (scheduling, input packing, results, audio bookkeeping) is paid
        once per k frames. The codes are the same as k = 1 (the counter-based sampler keys on the step).
        None: 8 on CUDA with async scheduling (served with the fp8 cache on an H100, against 4 on the same
        machine: 1.13-1.16x the audio-s/s at 512 streams, 1.04x at 256, 1.11x at 128, TTFA no later;
        BENCHMARKS.md), else 1 (a CPU step is bound by its compute, not by the host's bookkeeping).
    async_scheduling: the engine schedules and queues step n + 1 on the device before it reads step n's
        results, so the host's bookkeeping overlaps the device's work (vLLM V1's asynchronous scheduling;
        engine/scheduler.py says what waits for an in-flight result). None: on with CUDA (and CUDA graphs),
        off on the CPU, where torch runs each op in the calling thread and there is nothing to overlap.
    audio_stream: on CUDA, the streaming vocoder queues its device work (frame appends, calls, crops, copies to
        the host) on a CUDA stream of its own, so its kernels run beside the GPT's (audio/stream_base.py); the
        audio is the same sample for sample. Off by default: on an H100 at 512 served streams it cost 5-13 % with
        the fp8 KV cache (the overlapping calls slowed the GPT step the host waited for) and its gain with the
        bf16 cache was within the run-to-run spread (docs/benchmarks-history.md). No effect on the CPU.
    cpu_threads: intra-op threads on the CPU; None = $OMP_NUM_THREADS, else the physical cores this process
        may use (ttsserve/runner/cpu_threads.py).
    background_graph_capture: on CUDA, capture only each CUDA-graph family's largest bucket while the engine
        starts and the others after it is ready, between served steps (engine/deferred_capture.py): ready
        in seconds instead of tens of seconds; until a batch's own bucket is captured it replays the next
        larger one; only a serving loop (`ttsserve serve`, Ray replicas) captures the rest, an Engine driven
        directly does so in wait_warm(). `ttsserve serve` turns it on unless told otherwise; None / False here:
        every graph before ready, full speed from the first request. docs/DEPLOY.md's cold start says what
        each measured to give.
    """

    model: str | None = None
    load_format: str = "auto"
    dummy_size: str = "real"
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    verify_sha256: bool = False
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    swap_space: float = 4.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    target_step_latency_ms: float = 0.0
    first_chunk_frames: int = 8
    max_chunk_frames: int = 64
    lookahead_frames: int | None = None
    first_chunk_lookahead_frames: int | None = None
    vocoder_cadence: int | None = None
    admission_interval: int | None = None
    num_scheduler_steps: int | None = None
    async_scheduling: bool | None = None
    audio_stream: bool = False
    enforce_eager: bool = False
    max_queue_len: int = 1024
    cpu_threads: int | None = None
    background_graph_capture: bool | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.load_format in ("auto", "safetensors", "dummy"), "load_format must be auto|safetensors|dummy"),
            (self.dummy_size in ("real", "tiny"), "dummy_size must be real|tiny"),
            (0 <= self.seed < 2**63, "seed (of the dummy weights) must be in [0, 2**63)"),
            (
                self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
                "device must be auto|cpu|cuda[:N]",
            ),
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype must be auto|float32|bfloat16|float16"),
            (self.quantization in (None, "int8", "awq-int4"), "quantization must be int8|awq-int4"),
            (self.kv_cache_dtype in ("auto", "fp8"), "kv_cache_dtype must be auto|fp8"),
            (self.block_size in (8, 16, 32, 64, 128), "block_size must be one of 8, 16, 32, 64, 128"),
            (0.05 <= self.gpu_memory_utilization <= 0.99, "gpu_memory_utilization must be in [0.05, 0.99]"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be > 0"),
            (self.swap_space >= 0, "swap_space must be >= 0"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.preemption_mode in ("auto", "recompute", "swap"), "preemption_mode must be auto|recompute|swap"),
            (16 <= self.max_model_len <= 1 << 20, "max_model_len must be in [16, 2**20]"),
            (self.target_step_latency_ms >= 0, "target_step_latency_ms must be >= 0"),
            (1 <= self.first_chunk_frames <= self.max_chunk_frames, "need 1 <= first_chunk_frames <= max_chunk_frames"),
            (self.max_queue_len >= 1, "max_queue_len must be >= 1"),
            (self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1"),
            (self.lookahead_frames is None or self.lookahead_frames >= 1, "lookahead_frames must be >= 1"),
            (
                self.first_chunk_lookahead_frames is None or self.first_chunk_lookahead_frames >= 1,
                "first_chunk_lookahead_frames must be >= 1",
            ),
            (
                self.first_chunk_lookahead_frames is None or self.lookahead_frames is None,
                "first_chunk_lookahead_frames applies to the exact vocoder only: unset lookahead_frames",
            ),
            (self.vocoder_cadence is None or 1 <= self.vocoder_cadence <= 64, "vocoder_cadence must be in [1, 64]"),
            (
                self.admission_interval is None or 1 <= self.admission_interval <= 64,
                "admission_interval must be in [1, 64]",
            ),
            (
                self.num_scheduler_steps is None or 1 <= self.num_scheduler_steps <= 16,
                "num_scheduler_steps must be in [1, 16]",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit into one step's budget.
            self.max_num_batched_tokens = self.max_model_len

    def default_max_num_seqs(self, device_type: str) -> int:
        """max_num_seqs when not given, before the KV pool is known (the engine then lowers it to the streams of
        10-s utterances the pool holds, runner/kv_cache.py rows_that_fit). CUDA: 512 (the H200 served 1,451
        audio-s/s at 512 streams against 1,096-1,170 capped at 256, and the same at 256 streams); CPU: 256."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return 512 if device_type == "cuda" else 256

    def step_intervals(self, device_type: str) -> tuple[int, int]:
        """(vocoder_cadence, admission_interval) with the defaults of `device_type` filled in (in engine steps:
        on CUDA 8 frames' worth, so a decode burst of k frames per step waits 8 // k steps)."""
        auto = max(1, 8 // self.scheduler_steps(device_type)) if device_type == "cuda" else 1
        cadence = self.vocoder_cadence or (1 if self.lookahead_frames is not None else auto)  # windowed: none
        return cadence, self.admission_interval or auto

    def scheduler_steps(self, device_type: str) -> int:
        """num_scheduler_steps with the default of `device_type` filled in."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return 8 if device_type == "cuda" and self.pipelined(device_type) else 1

    def pipelined(self, device_type: str) -> bool:
        """async_scheduling with the default of `device_type` filled in."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda" and not self.enforce_eager
