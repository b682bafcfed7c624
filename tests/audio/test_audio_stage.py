"""Both streaming stages (windowed AudioStage, IncrementalAudioStage): streamed chunks == one-shot decode,
batched == single, request lifecycle; the windowed stage's context and lookahead. The incremental stage's own
properties: tests/audio/test_incremental_stage.py."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ttsserve.audio.decoder_net import DVAE, ConvNeXtBlock, ConvNeXtStack, HiddenDecoder
from ttsserve.audio.gfsq import GFSQ
from ttsserve.audio.incremental_stage import IncrementalAudioStage
from ttsserve.audio.stage import AudioChunk, AudioStage, context_frames
from ttsserve.audio.stream_base import StreamingStage
from ttsserve.audio.vocos import ISTFTHead, Vocos, VocosBackbone

ASSET = Path(__file__).resolve().parents[1] / "golden" / "assets-tiny" / "asset"
STAGES = [AudioStage, IncrementalAudioStage]


@pytest.fixture(scope="module")
def tiny() -> tuple[HiddenDecoder, DVAE, Vocos]:
    load = lambda name: load_file(ASSET / f"{name}.safetensors")  # noqa: E731
    return (
        HiddenDecoder.from_state_dict(load("Decoder")),
        DVAE.from_state_dict(load("DVAE")),
        Vocos.from_state_dict(load("Vocos")),
    )


@torch.no_grad()
def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights like the golden tiny checkpoint's: N(0, 1/fan_in), small biases, scales U(0.05, 0.2)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("weight", "gamma") and p.dim() == 1 and ".norm" not in name and "layer_norm" not in name:
            p.copy_(torch.rand(p.shape, generator=g) * 0.15 + 0.05)  # ConvNeXt layer scale
        elif p.dim() == 1:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if "norm" in name else 0.0))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    for name, b in module.named_buffers():
        if name.endswith("coef"):
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return module.eval()


def random_nets(
    seed: int, hidden: int, dec_dim: int, dec_layers: int, voc_dim: int, voc_layers: int, dvae: bool = False
) -> tuple[HiddenDecoder, DVAE | None, Vocos]:
    """Random Decoder (and DVAE) + Vocos; the real model is hidden 768, dec 512 x 12, Vocos 512 x 8."""
    dec = HiddenDecoder(ConvNeXtStack(hidden // 2, hidden // 2, dec_dim, 128, dec_layers, 4 * dec_dim), 100)
    voc = Vocos(VocosBackbone(100, voc_dim, 3 * voc_dim, voc_layers), ISTFTHead(voc_dim, 1024))
    dv = None
    if dvae:
        dv = DVAE(
            ConvNeXtStack(64, 128, 64, 16, dec_layers, 256),
            ConvNeXtStack(64, 64, 64, 16, dec_layers, 256),
            GFSQ(128),
            100,
            1024,
        )
        dv = _randomize(dv, seed + 2)
    return _randomize(dec, seed), dv, _randomize(voc, seed + 1)


@torch.no_grad()
def one_shot(dec, vocos, frames: torch.Tensor, codes: bool = False) -> np.ndarray:
    mel = dec.decode_codes(frames.T[None]) if codes else dec(frames.T[None])
    return vocos(mel)[0].numpy()


def stream(
    stage: StreamingStage, req_id: str, frames: torch.Tensor, bursts: list[int] | None = None, use_codes: bool = False
) -> list[AudioChunk]:
    """Feed frames in bursts (default: one per step), step after each, then finish and flush."""
    stage.add_request(req_id, use_codes=use_codes)
    chunks: list[AudioChunk] = []
    i = 0
    for k in bursts or [1] * frames.shape[0]:
        stage.append(req_id, frames[i : i + k])
        i += k
        chunks += stage.step()
    stage.finish(req_id)
    chunks += stage.step()
    return chunks + stage.flush()  # deferred stages hand the last decode over here


def joined(chunks: list[AudioChunk]) -> np.ndarray:
    """Concatenate, checking the chunk contract (contiguous start_sample, one final chunk at the end)."""
    pos = 0
    for i, ch in enumerate(chunks):
        assert ch.start_sample == pos and ch.samples.dtype == np.float32
        assert ch.is_final == (i == len(chunks) - 1)
        pos += len(ch.samples)
    return np.concatenate([ch.samples for ch in chunks])


def run_schedule(
    stage: IncrementalAudioStage, specs: list[tuple[int, int, int]], seed: int, width: int = 64
) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
    """Streams (length, start step, burst) of random [n, width] frames appended step by step; -> each stream's
    (joined audio, frames)."""
    g = torch.Generator().manual_seed(seed)
    frames = [torch.randn(n, width, generator=g) for n, _, _ in specs]
    fed, got, finished = [0] * len(specs), {i: [] for i in range(len(specs))}, [False] * len(specs)
    for t in range(300):
        for i, (n, start, burst) in enumerate(specs):
            if t == start:
                stage.add_request(str(i))
            if start <= t and fed[i] < n:
                stage.append(str(i), frames[i][fed[i] : fed[i] + burst])
                fed[i] = min(n, fed[i] + burst)
            if start <= t and fed[i] == n and not finished[i]:
                stage.finish(str(i))
                finished[i] = True
        for ch in stage.step():
            got[int(ch.req_id)].append(ch)
        if t > max(s for _, s, _ in specs) and stage.num_requests == 0:
            break
    for ch in stage.flush():  # deferred stages hand the last decode over here
        got[int(ch.req_id)].append(ch)
    assert stage.num_requests == 0
    return {i: (joined(got[i]), frames[i]) for i in got}


@pytest.mark.parametrize("stage_cls", STAGES)
@pytest.mark.parametrize("n", [1, 7, 8, 21, 22, 60, 257])
def test_stitched_equals_one_shot_tiny(tiny, n, stage_cls) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
    wav = joined(stream(stage_cls(dec, None, vocos), "r", frames))
    ref = one_shot(dec, vocos, frames)
    assert wav.shape == (512 * n - 256,)
    assert np.abs(wav - ref).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_stitched_equals_one_shot_dvae_codes(tiny, stage_cls) -> None:
    _, dvae, vocos = tiny
    codes = torch.randint(0, 625, (90, 4), generator=torch.Generator().manual_seed(1))
    stage = stage_cls(None, dvae, vocos, first_chunk_frames=4, max_chunk_frames=16)
    wav = joined(stream(stage, "c", codes, [3] * 30, use_codes=True))
    assert np.abs(wav - one_shot(dvae, vocos, codes, codes=True)).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_stitched_equals_one_shot_real_sizes_in_bursts(stage_cls) -> None:
    dec, _, vocos = random_nets(0, hidden=768, dec_dim=512, dec_layers=2, voc_dim=512, voc_layers=2)
    frames = torch.randn(150, 768, generator=torch.Generator().manual_seed(2))
    bursts = [5, 1, 17, 40, 2, 64, 21]
    wav = joined(stream(stage_cls(dec, None, vocos, first_chunk_frames=4, max_chunk_frames=32), "r", frames, bursts))
    ref = one_shot(dec, vocos, frames)
    assert np.abs(ref).max() > 0.05  # a meaningful signal
    assert np.abs(wav - ref).max() < 1e-4


@torch.no_grad()
def _sample_extent(dec, vocos, width: int, n: int, f: int) -> tuple[int, int]:
    """Impulse test in float64: samples changed by perturbing frame f, as (left, right) offsets from 512 f."""
    dec, vocos = copy.deepcopy(dec).double(), copy.deepcopy(vocos).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, width, generator=g, dtype=torch.float64)
    y = torch.randn(width, generator=g, dtype=torch.float64)
    base = vocos(dec(x.T[None]))[0]
    x[f] += y
    changed = torch.nonzero(vocos(dec(x.T[None]))[0] != base)[:, 0]
    return 512 * f - int(changed[0]), int(changed[-1]) - 512 * f


def _contexts_from_extent(left: int, right: int) -> tuple[int, int]:
    # frame a-L-1 must not reach sample 512 a; frame b+R must not reach sample 512 b - 1
    return right // 512, (left - 1) // 512 + 1


def test_receptive_field_measured_by_impulse_tiny(tiny) -> None:
    dec, _, vocos = tiny
    w = dec.receptive_field + vocos.receptive_field
    assert w == 24
    left, right = _sample_extent(dec, vocos, 64, 80, 40)
    # analytic: spectrum frames [2f - w, 2f + 1 + w], each reaching n_fft/2 - 1 samples around hop * t
    # (the periodic Hann window is 0 at its first sample)
    assert (left, right) == (256 * w + 511, 256 * (w + 1) + 511)
    stage = AudioStage(dec, None, vocos)
    assert _contexts_from_extent(left, right) == (stage.left_context_frames, stage.right_context_frames) == (13, 13)


def test_full_depth_receptive_field_and_stitching() -> None:
    # the real depth (12 decoder + 8 Vocos blocks) with small widths: W = 75 + 27 = 102 mel frames
    dec, _, vocos = random_nets(4, hidden=64, dec_dim=64, dec_layers=12, voc_dim=64, voc_layers=8)
    assert dec.receptive_field == 75 and vocos.receptive_field == 27
    stage = AudioStage(dec, None, vocos)
    assert (stage.left_context_frames, stage.right_context_frames) == context_frames(102, 1024, 256) == (52, 52)
    # the influence of the outermost taps falls below fp64 resolution: the measured field is a bit smaller
    left, right = _sample_extent(dec, vocos, 64, 160, 80)
    assert left <= 256 * 102 + 511 and right <= 256 * 103 + 511
    measured = _contexts_from_extent(left, right)
    assert 40 <= measured[0] <= 52 and 40 <= measured[1] <= 52
    frames = torch.randn(200, 64, generator=torch.Generator().manual_seed(5))
    wav = joined(stream(stage, "r", frames, [4] * 50))
    assert np.abs(wav - one_shot(dec, vocos, frames)).max() < 1e-5


def _edge_heavy_nets() -> tuple[HiddenDecoder, Vocos]:
    """Convs that only use their outermost taps: the edge of the receptive field matters at full strength."""
    dec, _, vocos = random_nets(0, hidden=64, dec_dim=64, dec_layers=2, voc_dim=64, voc_layers=2)
    with torch.no_grad():
        for m in [*dec.modules(), *vocos.modules()]:
            if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1:
                m.weight[..., 1:-1] = 0
            if isinstance(m, ConvNeXtBlock):
                getattr(m, m.scale_name).fill_(1.0)
    return dec, vocos


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_context_is_tight(side) -> None:
    dec, vocos = _edge_heavy_nets()
    frames = torch.randn(100, 64, generator=torch.Generator().manual_seed(6))
    stage = AudioStage(dec, None, vocos)
    if side is not None:  # one frame less context than derived
        setattr(stage, f"{side}_context_frames", getattr(stage, f"{side}_context_frames") - 1)
    diff = np.abs(joined(stream(stage, "r", frames, [4] * 25)) - one_shot(dec, vocos, frames)).max()
    assert (diff < 1e-5) if side is None else (diff > 1e-4)


def test_lookahead_trades_exactness_for_latency(tiny) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    ref = one_shot(dec, vocos, frames)
    diffs = {}
    for lookahead in (1, 4, 13):
        stage = AudioStage(dec, None, vocos, lookahead_frames=lookahead)
        stage.add_request("r")
        first_at = None
        for i in range(100):
            stage.append("r", frames[i : i + 1])
            if stage.step() and first_at is None:
                first_at = i + 1
        stage.finish("r")
        stage.step()
        assert first_at == 8 + lookahead  # first_chunk_frames + lookahead frames before the first audio
        stage2 = AudioStage(dec, None, vocos, lookahead_frames=lookahead)
        diffs[lookahead] = float(np.abs(joined(stream(stage2, "r", frames)) - ref).max())
    assert diffs[13] < 1e-5 < diffs[1]  # 13 = exact right context of the tiny model


@pytest.mark.parametrize("stage_cls", STAGES)
def test_batched_step_equals_single_requests(tiny, stage_cls) -> None:
    dec, dvae, vocos = tiny
    g = torch.Generator().manual_seed(8)
    lengths = {"a": 70, "b": 3, "c": 41, "d": 0}
    frames = {k: torch.randn(n, 64, generator=g) for k, n in lengths.items()}
    codes = torch.randint(0, 625, (50, 4), generator=g)
    stage = stage_cls(dec, dvae, vocos)
    got: dict[str, list[AudioChunk]] = {k: [] for k in [*lengths, "q"]}
    for k in got:
        stage.add_request(k, use_codes=k == "q")
    for t in range(80):
        live = [k for k in lengths if t < lengths[k]]
        if live:  # one frame of every live request in one write, as the engine does
            stage.append_batch(live, torch.stack([frames[k][t] for k in live]))
        if t < 50:
            stage.append("q", codes[t : t + 1])
        for k in [*lengths, "q"]:
            if t == (50 if k == "q" else lengths[k]):
                stage.finish(k)
        calls = stage.calls_total
        for ch in stage.step():
            got[ch.req_id].append(ch)
        assert stage.calls_total - calls <= 1  # never one call per request
    assert stage.num_requests == 0
    for k in lengths:  # each request alone, same append schedule
        single = stage_cls(dec, None, vocos)
        alone = stream(single, k, frames[k]) if lengths[k] else stream(single, k, frames[k], [])
        assert [(c.start_sample, len(c.samples), c.is_final) for c in got[k]] == [
            (c.start_sample, len(c.samples), c.is_final) for c in alone
        ]
        assert np.abs(joined(got[k]) - joined(alone)).max(initial=0.0) < 1e-6
    assert np.abs(joined(got["q"]) - one_shot(dvae, vocos, codes, codes=True)).max() < 1e-5


@pytest.mark.parametrize("n", [400, 1600])
def test_work_is_linear_in_frames(tiny, n) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos)
    chunks = stream(stage, "r", torch.randn(n, 64, generator=torch.Generator().manual_seed(9)))
    ctx = stage.left_context_frames + stage.right_context_frames
    ramp = 4  # chunks 8, 16, 32 before reaching 64
    assert len(chunks) == stage.calls_total <= ramp + n // 64 + 1
    assert stage.frames_decoded_total <= n + stage.calls_total * ctx
    assert stage.frames_decoded_total <= 2.5 * n
    # frames no window needs are dropped: the per-request buffer never grew
    assert stage._pools[False].capacity == 2 * (ctx + 64)


def test_burst_larger_than_buffer_grows_it(tiny) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos)
    frames = torch.randn(500, 64, generator=torch.Generator().manual_seed(10))
    chunks = stream(stage, "r", frames, [500])  # all at once, then one step emits every ready window
    assert np.abs(joined(chunks) - one_shot(dec, vocos, frames)).max() < 1e-5
    assert stage.calls_total == 2


def test_short_request_emits_everything_on_finish(tiny) -> None:
    dec, _, vocos = tiny
    stage = AudioStage(dec, None, vocos, lookahead_frames=1)
    frames = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    stage.add_request("r")
    stage.append("r", frames)
    assert stage.step() == []
    stage.finish("r")
    (chunk,) = stage.step()
    assert chunk.is_final and chunk.start_sample == 0 and chunk.samples.shape == (512 * 3 - 256,)
    assert np.abs(chunk.samples - one_shot(dec, vocos, frames)).max() < 1e-5
    assert stage.num_requests == 0 and stage.step() == []


@pytest.mark.parametrize("stage_cls", STAGES)
def test_zero_frame_request_emits_one_empty_final_chunk(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    stage = stage_cls(dec, None, vocos)
    stage.add_request("z")
    assert stage.step() == []
    stage.finish("z")
    (chunk,) = stage.step()
    assert chunk.req_id == "z" and chunk.is_final and chunk.samples.size == 0 and chunk.start_sample == 0
    assert stage.calls_total == 0 and stage.num_requests == 0


@pytest.mark.parametrize("stage_cls", STAGES)
def test_abort_frees_state_and_slot(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    stage = stage_cls(dec, None, vocos)
    stage.add_request("a")
    stage.append("a", torch.randn(40, 64))
    slot = stage._streams["a"].slot
    stage.abort("a")
    assert stage.num_requests == 0 and stage.step() == []
    stage.abort("a")  # idempotent
    with pytest.raises(ValueError, match="unknown request 'a'"):
        stage.append("a", torch.randn(1, 64))
    stage.add_request("a")  # the id and the slot can be reused
    assert stage._streams["a"].slot == slot and stage._streams["a"].num_frames == 0


@pytest.mark.parametrize("stage_cls", STAGES)
def test_bad_inputs_raise_value_error(tiny, stage_cls) -> None:
    dec, dvae, vocos = tiny
    with pytest.raises(ValueError, match="lookahead_frames"):
        AudioStage(dec, None, vocos, lookahead_frames=0)
    with pytest.raises(ValueError, match="first_chunk_frames"):
        stage_cls(dec, None, vocos, first_chunk_frames=16, max_chunk_frames=8)
    with pytest.raises(ValueError, match="needs a decoder or a dvae"):
        stage_cls(None, None, vocos)
    stage = stage_cls(dec, None, vocos)
    with pytest.raises(ValueError, match="no DVAE"):
        stage.add_request("q", use_codes=True)
    stage.add_request("r")
    with pytest.raises(ValueError, match="already exists"):
        stage.add_request("r")
    with pytest.raises(ValueError, match=r"must be \[n, 64\]"):
        stage.append("r", torch.randn(2, 63))
    with pytest.raises(ValueError, match="float hidden states"):
        stage.append("r", torch.zeros(2, 64, dtype=torch.long))
    stage.finish("r")
    with pytest.raises(ValueError, match="finished"):
        stage.append("r", torch.randn(1, 64))


@pytest.mark.parametrize("stage_cls", STAGES)
def test_bf16_frame_buffer_decodes_in_the_networks_dtype(tiny, stage_cls) -> None:
    dec, _, vocos = tiny
    frames = torch.randn(40, 64, generator=torch.Generator().manual_seed(14))
    stage = stage_cls(dec, None, vocos, dtype=torch.bfloat16)
    assert stage._pools[False].data.dtype == torch.bfloat16
    wav = joined(stream(stage, "r", frames))
    assert np.abs(wav - one_shot(dec, vocos, frames.bfloat16().float())).max() < 1e-5


@pytest.mark.parametrize("stage_cls", STAGES)
def test_multi_frame_append_batch_equals_frame_by_frame(tiny, stage_cls) -> None:
    """A decode burst's frames [m, n, C] (step-major) in one write give the pool, and so the audio, of m
    single-frame writes; 201 frames run past the pool's capacity (its slots shift or grow on the way)."""
    dec, _, vocos = tiny
    g = torch.Generator().manual_seed(9)
    frames = torch.randn(201, 3, 64, generator=g)  # [t, request, C]
    ids = ["x", "y", "z"]
    out = {}
    for m in (1, 3):
        stage = stage_cls(dec, None, vocos)
        for k in ids:
            stage.add_request(k)
        chunks = {k: [] for k in ids}
        for t in range(0, 201, m):
            stage.append_batch(ids, frames[t : t + m] if m > 1 else frames[t])
            if t + m == 201:
                for k in ids:
                    stage.finish(k)
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        while stage.num_requests:
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        out[m] = {k: joined(v) for k, v in chunks.items()}
    for k in ids:
        assert len(out[3][k]) == len(out[1][k]) > 0
        assert np.abs(out[3][k] - out[1][k]).max() < 1e-6
    stage = stage_cls(dec, None, vocos)
    stage.add_request("x")
    with pytest.raises(ValueError, match=r"\[m, 1, C\]"):
        stage.append_batch(["x"], torch.zeros(2, 2, 64))


@pytest.mark.parametrize("stage_cls", STAGES)
def test_append_batch_counts_keep_each_rows_first_frames(tiny, stage_cls) -> None:
    """append_batch(ids, [4, n, C], counts): request i gets frames[:counts[i], i] (a burst cut by EOS, a row
    whose results were dropped: 0, its id not live), the same audio as appending those frames one by one;
    the rows run past the pool's capacity together, so their slots shift in one batched move."""
    dec, _, vocos = tiny
    g = torch.Generator().manual_seed(21)
    ids = ["x", "y", "z"]
    bursts = [torch.randn(4, 4, 64, generator=g) for _ in range(60)]  # [m, rows (ids + a dead row), C]
    counts = [np.array([4, 4 - t % 5 % 4, 4 if t % 7 else 0, 0]) for t in range(60)]
    out = {}
    for batched in (True, False):
        stage = stage_cls(dec, None, vocos)
        for k in ids:
            stage.add_request(k)
        chunks = {k: [] for k in ids}
        for frames, c in zip(bursts, counts):
            if batched:
                stage.append_batch([*ids, "gone"], frames, c)
            else:
                for i, k in enumerate(ids):
                    for j in range(c[i]):
                        stage.append(k, frames[j, i : i + 1])
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        for k in ids:
            stage.finish(k)
        while stage.num_requests:
            for ch in stage.step():
                chunks[ch.req_id].append(ch)
        out[batched] = {k: joined(v) for k, v in chunks.items()}
    for k in ids:
        assert len(out[True][k]) == len(out[False][k]) > 0
        assert np.array_equal(out[True][k], out[False][k])
