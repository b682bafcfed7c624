"""Model and engine flags, generated from EngineConfig's fields: one source for every CLI.

A field `block_size` is the flag `--block-size` (booleans get `--x/--no-x`), so a knob added to EngineConfig
is a flag of every command without touching a parser. Two modes:
- env=False (`say`, `bench offline`, `quantize`, `bench quality`): typed flags with EngineConfig's defaults
  (or the caller's `defaults`) and choices;
- env=True (`serve`): every flag defaults to None and also reads TTSSERVE_<FIELD>; precedence flag >
  environment variable > EngineConfig's default, resolved by engine_kwargs(args, env).
engine_kwargs() reads back only the fields these functions added (recorded in the parser's defaults), so a
command's own `--seed` (say's sampling seed) never leaks into EngineConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterable, Mapping

from ttsserve.config import EngineConfig

ENV_PREFIX = "TTSSERVE_"
# The checkpoint and its number formats; the rest of EngineConfig is the engine's (add_engine_args).
MODEL_FIELDS = (
    "model",
    "load_format",
    "dummy_size",
    "device",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "verify_sha256",
)
CHOICES = {
    "load_format": ("auto", "safetensors", "dummy"),
    "dummy_size": ("real", "tiny"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "quantization": ("int8", "awq-int4"),
    "kv_cache_dtype": ("auto", "fp8"),
    "preemption_mode": ("auto", "recompute", "swap"),
}
HELP = {
    "model": "checkpoint folder or hub id (default: $TTSSERVE_MODEL, ./asset, the hub cache)",
    "load_format": "auto | safetensors | dummy (random weights)",
    "dummy_size": "real | tiny: size of random weights for --load-format dummy",
    "device": "auto | cpu | cuda | cuda:N",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and on CPUs with native bf16, else fp32)",
    "quantization": "int8 | awq-int4 (weight-only; a quantized checkpoint from `ttsserve quantize` is detected)",
    "kv_cache_dtype": "auto | fp8 (e4m3 KV cache with per-token-head scales; CUDA only)",
    "lookahead_frames": "right context of streamed windows; unset = exact (stitched stream == one-shot decode)",
    "first_chunk_frames": "frames in the first streamed audio chunk (later chunks double up to max_chunk_frames)",
    "first_chunk_lookahead_frames": "exact vocoder: the first audio leaves after this many frames of right context "
    "instead of 52, in early chunks up to 32 frames (16: within 7e-6 of exact, a quarter of a 16-bit step), every "
    "later sample exact",
    "block_size": "KV cache block size in frames (8, 16, 32, 64, 128)",
    "gpu_memory_utilization": "fraction of GPU memory for weights + activations + KV cache",
    "kv_cache_memory": "bytes for the KV pool (suffixes K/M/G/KiB/MiB/GiB accepted)",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "max_num_seqs": "most sequences (text segments being spoken) in one engine step's batch; unset: 512 on CUDA "
    "(no more than the KV pool holds 10-s utterances), 256 on the CPU",
    "max_num_batched_tokens": "most tokens of one forward pass in an engine step (prompt positions, plus one a "
    "decoding stream: a decode burst's k frames are k passes)",
    "enable_chunked_prefill": "split long prompts across steps so running streams keep getting frames",
    "preemption_mode": "auto | recompute | swap: how a sequence gives up its KV blocks when the pool runs out "
    "(auto: swap to host memory while host blocks are free, else recompute later)",
    "seed": "seed of the random weights of --load-format dummy (sampling seeds are per request)",
    "verify_sha256": "check the checkpoint files against their published SHA-256 sums before loading",
    "max_model_len": "most positions (prompt tokens + frames) of one sequence; ChatTTS has 4096",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes shared between requests (same voice + text start)",
    "max_chunk_frames": "frames in later streamed audio chunks (they double from --first-chunk-frames up to this; "
    "21.3 ms of audio per frame)",
    "vocoder_cadence": "run the streaming vocoder every k engine steps, for all due streams at once "
    "(default: every 8 frames on CUDA, every step on the CPU)",
    "admission_interval": "while streams run, start new requests every k engine steps only, together "
    "(default: every 8 frames on CUDA, every step on the CPU)",
    "enforce_eager": "no CUDA graphs and no torch.compile: plain eager PyTorch (slower; for debugging)",
    "background_graph_capture": "capture each CUDA-graph family's largest bucket before ready and the others "
    "after, between steps (a batch replays the next larger captured bucket meanwhile; the default of `serve`); "
    "--no-background-graph-capture captures every graph before ready (a slower start, full speed from the "
    "first request; the default of an Engine built directly)",
    "cpu_threads": "intra-op threads on the CPU (default: $OMP_NUM_THREADS, else the usable physical cores)",
    "max_queue_len": "most requests in the engine (queued + running); also the server's in-flight bound",
    "target_step_latency_ms": "dynamic batching goal; 0 disables the controller",
    "async_scheduling": "schedule and queue step n+1 while step n runs on the GPU (default: on with CUDA)",
    "audio_stream": "run the vocoder's GPU work on a CUDA stream of its own, beside the GPT's (CUDA only)",
    "num_scheduler_steps": "decode steps per schedule: a stream's next k frames run back to back on the device, "
    "host bookkeeping once per k (multi-step scheduling; same codes as 1)",
}
ENGINE_FIELDS_DEST = "_engine_fields"  # the parser default listing the fields added here
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1.5g', '1073741824' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4GiB, 512M or a byte count)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def parse_bool(text: str) -> bool:
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def converter(name: str, annotation: str):
    """A str -> value function for a field, from its (string) annotation."""
    if name == "kv_cache_memory":
        return parse_size
    base = annotation.replace("| None", "").replace("None |", "").strip()
    return {"bool": parse_bool, "int": int, "float": float}.get(base, str)


def engine_fields() -> list[tuple[str, object, str]]:
    """(name, default, annotation) of every EngineConfig field, in declaration order."""
    return [(f.name, f.default, str(f.type)) for f in dataclasses.fields(EngineConfig)]


def add_model_args(
    parser: argparse.ArgumentParser,
    *,
    env: bool = False,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, object] | None = None,
    helps: Mapping[str, str] | None = None,
    title: str = "model",
) -> None:
    """The checkpoint flags (MODEL_FIELDS, or the subset `only`) in a group of `parser`."""
    names = MODEL_FIELDS if only is None else tuple(only)
    _add_fields(parser, title, names, env, defaults or {}, helps or {})


def add_engine_args(
    parser: argparse.ArgumentParser,
    *,
    env: bool = False,
    exclude: Iterable[str] = (),
    defaults: Mapping[str, object] | None = None,
    helps: Mapping[str, str] | None = None,
    title: str = "engine",
) -> None:
    """Every EngineConfig field that is not a model field (nor in `exclude`) as a flag in a group of `parser`."""
    skip = set(MODEL_FIELDS) | set(exclude)
    names = tuple(name for name, _d, _a in engine_fields() if name not in skip)
    _add_fields(parser, title, names, env, defaults or {}, helps or {})


def _add_fields(parser, title, names, env, defaults, helps) -> None:
    fields = {name: (default, annotation) for name, default, annotation in engine_fields()}
    group = parser.add_argument_group(title + (" (each flag also reads TTSSERVE_<NAME>)" if env else ""))
    for name in names:
        default, annotation = fields[name]
        flag, conv = "--" + name.replace("_", "-"), converter(name, annotation)
        text = helps.get(name) or HELP.get(name, name.replace("_", " "))
        if env:
            text = f"{text} [env {ENV_PREFIX + name.upper()}; default {default!r}]"
            default = None
        else:
            default = defaults.get(name, default)
        if conv is parse_bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif env:
            group.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=text)
        else:
            group.add_argument(
                flag, dest=name, type=_argparse_type(conv), default=default, choices=CHOICES.get(name), help=text
            )
    parser.set_defaults(**{ENGINE_FIELDS_DEST: (parser.get_default(ENGINE_FIELDS_DEST) or ()) + tuple(names)})


def _argparse_type(conv):
    if conv is str:
        return None

    def parse(text: str):
        try:
            return conv(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = conv.__name__  # argparse names the type in its "invalid int value" message
    return parse


def engine_kwargs(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict:
    """The EngineConfig keyword arguments the generated flags set (unset ones left to EngineConfig's defaults).
    env: the environment for flags added with env=True (flag > TTSSERVE_<FIELD> > default); ValueError names
    the flag or variable of a bad value."""
    fields = {name: annotation for name, _d, annotation in engine_fields()}
    out = {}
    for name in getattr(args, ENGINE_FIELDS_DEST, ()):
        value = getattr(args, name, None)
        if env is not None:
            value = read_value(args, name, converter(name, fields[name]), env)
        if value is not None:
            out[name] = value
    return out


def read_value(args: argparse.Namespace, dest: str, conv, env: Mapping[str, str]):
    """The flag's value if given, else the env var's, else None. ValueError names the flag or variable."""
    raw = getattr(args, dest, None)
    source = "--" + dest.replace("_", "-")
    if raw is None:
        raw = env.get(ENV_PREFIX + dest.upper())
        source = ENV_PREFIX + dest.upper()
        if raw is None or raw == "":
            return None
    if isinstance(raw, bool):
        return raw
    try:
        return conv(raw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
