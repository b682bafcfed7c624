"""gpu_bench.py's vocoder section: Decoder + Vocos alone, without the GPT. One batched call of the windowed
stage's networks in fp32, bf16 and fp16 (time, and the 16-bit waveforms' error against fp32), and one steady
step() of each streaming stage (windowed, incremental) with fp16 networks, host work included.

Run it through gpu_bench.py: python3 benchmarks/gpu_bench.py --out DIR --sections vocoder
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_engine import gpu_time_ms, sync


@torch.no_grad()
def sec_vocoder(ctx: dict) -> dict:
    from ttsserve.audio.stage import AudioStage
    from ttsserve.h2d import to_device

    m, out = ctx["model"], {}
    stages = {
        "fp32": AudioStage(m.decoder, None, m.vocos, device=m.device),
        "bf16": AudioStage(m.decoder, None, m.vocos, device=m.device, net_dtype=torch.bfloat16),
        "fp16": AudioStage(m.decoder, None, m.vocos, device=m.device, net_dtype=torch.float16),
    }
    n = stages["fp32"].max_window_frames
    b = 64
    x = torch.randn(b, m.decoder.hidden_size, n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    lens = to_device([n] * b, m.device)
    wavs = {}
    for name, st in stages.items():

        def call(st=st):
            mel = st.decoder(x.to(st.decoder.coef.dtype), lens)
            return st.vocos(mel.to(next(st.vocos.parameters()).dtype), 2 * lens)

        wavs[name] = call().float()
        ms = gpu_time_ms(call, 10)
        emitted = b * st.max_chunk_frames  # frames a full call emits (the rest is context)
        out[name] = {
            "call_ms": ms,
            "windows": b,
            "window_frames": n,
            "emitted_audio_s_per_s": emitted / 46.875 / ms * 1e3,
        }
    from ttsserve.audio.incremental_stage import IncrementalAudioStage

    for name, cls in (("windowed", AudioStage), ("incremental", IncrementalAudioStage)):
        out[f"{name}_fp16_step"] = _stage_step(cls, m, b)
    ref = wavs["fp32"]
    for name in ("bf16", "fp16"):
        err = (wavs[name] - ref).norm() / ref.norm()
        out[f"{name}_rel_l2_error"] = float(err)
        out[f"{name}_snr_db"] = float(-20 * torch.log10(err))
    return out


def _stage_step(stage_cls, m, b: int) -> dict:
    """Wall time of one steady step() of a vocoder stage (fp16 nets, not deferred, synced): b streams that each
    bring max_chunk_frames new frames, host work included."""
    st = stage_cls(m.decoder, None, m.vocos, device=m.device, net_dtype=torch.float16)
    frames = torch.randn(st.max_chunk_frames + st.right_context_frames + 8, m.decoder.hidden_size, device=m.device)
    ids = [f"s{i}" for i in range(b)]
    for r in ids:
        st.add_request(r)
        st.append(r, frames[: st.first_chunk_frames + st.right_context_frames])
    st.step()
    times = []
    for k in range(14):  # chunks 16, 32, then max_chunk_frames: time the steady ones
        n = st._chunk_frames(k + 1)
        for r in ids:
            st.append(r, frames[:n])
        sync()
        t0 = time.perf_counter()
        st.step()
        sync()
        if n == st.max_chunk_frames and k > 4:
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    out = {
        "step_ms": ms,
        "streams": b,
        "new_frames_per_stream": st.max_chunk_frames,
        "emitted_audio_s_per_s": b * st.max_chunk_frames / 46.875 / ms * 1e3,
        "frames_decoded_per_emitted": st.frames_decoded_total
        / max(1, sum(s.num_emitted_frames for s in st._streams.values())),
    }
    if hasattr(st, "state_bytes_per_request"):
        out["state_bytes_per_request"] = st.state_bytes_per_request
    return out
