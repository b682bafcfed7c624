"""The runner's fast path on CPU: vectorised step arrays, the device sampling state (ring history), the decode
graphs' static-buffer body (run eagerly off CUDA), row reuse, and the engine's deferred audio."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_testutil import FrameRecorder, make_engine, run_all

from ttsserve.params import SamplingParams, SynthesisRequest
from ttsserve.runner.cuda_graphs import DecodeGraphs, default_capture_sizes
from ttsserve.runner.decode_ops import DecodeOps
from ttsserve.runner.input_batch import InputBatch
from ttsserve.runner.prefill_graphs import PrefillGraphs, default_prefill_sizes
from ttsserve.runner.sampler_graphs import SamplerGraphs, default_sampler_sizes
from ttsserve.sample.sampler import make_sampling_batch, sample
from ttsserve.sample.state import SamplingState


def test_step_arrays_match_per_token_loop():
    rng = random.Random(0)
    bs = 16
    ib = InputBatch(8, 64, bs, torch.device("cpu"))
    tables, rows, starts, num_new = {}, [], [], []
    for i in range(6):
        row, new = ib.assign(f"r{i}")
        assert new
        start, n = rng.randint(0, 300), rng.randint(1, 90)
        table = rng.sample(range(1000), -(-(start + n) // bs))
        ib.sync_block_table(row, table)
        tables[row] = table
        rows.append(row), starts.append(start), num_new.append(n)
    arr = ib.step_arrays(np.array(rows), np.array(starts), np.array(num_new), np.zeros(6, dtype=np.int64))
    want_pos, want_slots = [], []
    for row, start, n in zip(rows, starts, num_new):
        for p in range(start, start + n):
            want_pos.append(p)
            want_slots.append(tables[row][p // bs] * bs + p % bs)
    assert arr.positions.tolist() == want_pos and arr.slot_mapping.tolist() == want_slots
    assert arr.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum(num_new)]).tolist()
    assert arr.seq_lens.tolist() == [s + n for s, n in zip(starts, num_new)]
    assert ib.block_table[rows[2], : len(tables[rows[2]])].tolist() == tables[rows[2]]


def test_input_batch_rows_are_reused_and_grow():
    ib = InputBatch(2, 4, 16, torch.device("cpu"))
    a, _ = ib.assign("a")
    b, _ = ib.assign("b")
    assert ib.assign("a") == (a, False)
    ib.release("a")
    assert ib.assign("c") == (a, True)  # the freed row is reused
    gen = ib.generation
    d, _ = ib.assign("d")  # full: the tables grow, the rows kept
    assert ib.max_rows == 4 and ib.generation == gen + 1 and d not in (a, b)
    with pytest.raises(ValueError, match="KV blocks"):
        ib.sync_block_table(d, list(range(5)))


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, (0.5, 0.7, 1.0, 1.3)]),
        top_p=rng.choice([0.5, 0.7, 1.0]),
        top_k=rng.choice([1, 5, 20]),
        repetition_penalty=rng.choice([1.0, 1.05, 1.4]),
        repetition_window=rng.choice([3, 16]),
        min_new_tokens=rng.choice([0, 30]),
        greedy=rng.random() < 0.3,
    )


@pytest.mark.parametrize("mode", ["code", "text"])
def test_sampling_state_equals_host_built_batch(mode):
    """Rows initialised from host outputs, then recorded on the device for 20 steps, sample exactly what a
    SamplingBatch rebuilt from the Python history samples."""
    rng = random.Random(1)
    width, vocab, n = (4, 626, 12) if mode == "code" else (1, 300, 12)
    state = SamplingState(16, 4, 16, torch.device("cpu"))
    params = [_random_params(rng) for _ in range(n)]
    seeds = [rng.getrandbits(62) for _ in range(n)]
    hist = [
        [
            tuple(rng.randrange(vocab) for _ in range(width)) if mode == "code" else rng.randrange(vocab)
            for _ in range(rng.randint(0, 25))
        ]
        for _ in range(n)
    ]
    rows = rng.sample(range(16), n)
    state.set_rows(rows, params, seeds, [mode] * n, hist)
    rows_t = torch.tensor(rows)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        steps = [len(h) for h in hist]
        logits = torch.randn(n, width, vocab, generator=gen) * 3
        got = sample(logits, state.batch(rows_t, torch.tensor(steps), width, vocab - 1))
        ref = make_sampling_batch(
            params, seeds, steps, [torch.tensor(h).reshape(-1, width) for h in hist], width, vocab - 1
        )
        assert torch.equal(got, sample(logits, ref))
        state.record(rows_t, torch.tensor(steps), got)
        for i, t in enumerate(got.tolist()):
            hist[i].append(tuple(t) if mode == "code" else t[0])
        assert state.last_tokens[rows_t, :width].tolist() == [list(h[-1]) if mode == "code" else [h[-1]] for h in hist]


def _requests(n: int, frames: int = 20) -> list[SynthesisRequest]:
    rng = random.Random(3)
    words = ["hello", "world", "this", "is", "a", "test", "of", "the", "speech", "model"]
    return [
        SynthesisRequest(
            " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))),
            code_params=_random_params(rng).replace(seed=50 + i, max_new_tokens=frames, min_new_tokens=frames),
            raw_text=True,
            request_id=f"g{i}",
        )
        for i in range(n)
    ]


def _run(model, reqs, graphs: list[int] | None = None, **kw):
    e = make_engine(model, max_model_len=512, **kw)
    if graphs is not None:  # off CUDA the "graphs" run their captured body eagerly on the static buffers
        e.runner.graphs = DecodeGraphs(e.runner, graphs)
        e.runner.graphs.capture()
    rec = FrameRecorder(e)
    for r in reqs:
        e.add_synthesis(r)
    audio = run_all(e)
    return e, rec, audio


def test_graph_body_equals_eager_decode(tiny_model):
    """Padded buckets (5 -> 8, 3 -> 4, ...), rows from the persistent batch: same codes, same hiddens."""
    reqs = _requests(5)
    _, rec_eager, audio_eager = _run(tiny_model, reqs)
    e, rec_graph, audio_graph = _run(tiny_model, reqs, graphs=[1, 2, 4, 8])
    assert e.runner.timings.graph_steps > 10
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_graph.frames[seq] == rec_eager.frames[seq]
        np.testing.assert_allclose(rec_graph.hidden(seq), rec_eager.hidden(seq), atol=1e-5, rtol=0)
        np.testing.assert_allclose(audio_graph[r.request_id][0], audio_eager[r.request_id][0], atol=1e-5, rtol=0)


def test_fused_forward_hands_rope_to_the_attention(tiny_model):
    """The decode graph body's GPT: q / k reach attend unrotated, as views of the qkv projection, with
    rope = (cos, sin) of the positions; the attention applying it gives GPT.forward's hidden states."""
    from ttsserve.attention.dense import DenseAttention
    from ttsserve.runner.decode_ops import fused_gpt_forward

    gpt = tiny_model.gpt
    x = torch.randn(5, gpt.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5)
    calls = []

    class Recording(DenseAttention):
        def attend(self, layer_idx, q, k, v, rope=None):
            calls.append((q, k, rope))
            return super().attend(layer_idx, q, k, v, rope)

    with torch.inference_mode():
        got = fused_gpt_forward(gpt, DecodeOps(compile=False), x, positions, Recording(len(gpt.layers)))
        want = gpt(x, positions, DenseAttention(len(gpt.layers)))
        cos, sin = gpt.rotary(positions, gpt.dtype)
        normed = gpt.layers[0].input_layernorm(x)
        q_width = gpt.cfg.num_heads * gpt.cfg.head_dim
        q0 = gpt.layers[0].qkv_proj(normed)[:, :q_width].view_as(calls[0][0])
    assert len(calls) == len(gpt.layers) and all(torch.equal(r[0], cos) and torch.equal(r[1], sin) for *_, r in calls)
    assert torch.equal(calls[0][0], q0)  # unrotated
    assert calls[0][0].stride(0) == calls[0][1].stride(0) > q_width  # views of the one projection
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_graphs_recapture_when_the_history_window_grows(tiny_model):
    reqs = _requests(2)
    wide = reqs[1].code_params.replace(repetition_window=40, repetition_penalty=1.3)
    reqs[1] = SynthesisRequest(reqs[1].text, code_params=wide, raw_text=True, request_id="wide")
    _, rec_eager, _ = _run(tiny_model, reqs)
    e, rec_graph, _ = _run(tiny_model, reqs, graphs=[1, 2])
    assert e.runner.sampling.window == 40 and e.runner.graphs.generation == e.runner.generation
    assert rec_graph.frames == rec_eager.frames


def test_deferred_audio_gives_the_same_audio(tiny_model):
    reqs = _requests(3, frames=70)
    _, _, sync_audio = _run(tiny_model, reqs)
    e = make_engine(tiny_model, max_model_len=512)
    e.audio.deferred = True
    for r in reqs:
        e.add_synthesis(r)
    deferred_audio = run_all(e)
    for r in reqs:
        np.testing.assert_array_equal(deferred_audio[r.request_id][0], sync_audio[r.request_id][0])


def test_step_timings_and_stats(tiny_model):
    e, _, _ = _run(tiny_model, _requests(2))
    st = e.stats()
    assert st["cuda_graphs"] is False and st["graph_steps_total"] == 0
    assert set(st["step_breakdown_ms"]) >= {"schedule_ms", "runner_ms", "update_ms", "audio_step_ms"}
    assert all(v >= 0 for v in st["step_breakdown_ms"].values()) and st["step_breakdown_ms"]["runner_ms"] > 0


def test_default_capture_sizes():
    assert default_capture_sizes(256)[:4] == [1, 2, 4, 8] and default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def _run_staggered(
    model,
    reqs,
    graphs: list[int] | None,
    prefill_sizes: list[int] | None = None,
    sampler_sizes: list[int] | None = None,
    prefill_full: bool | None = None,
    block_m: int | None = None,
):
    """Request i arrives at step 4 * i, with a small token budget: its prefill chunks share steps with the
    decode rows of the earlier requests. prefill_full / block_m: the prefill graphs' full path (run eagerly on
    the CPU) and its query tile."""
    e = make_engine(model, max_model_len=512, max_num_batched_tokens=24)
    if graphs is not None:
        e.runner.graphs = DecodeGraphs(e.runner, graphs)
        e.runner.graphs.capture()
    if block_m is not None:
        e.runner.backend.tuning = SimpleNamespace(prefill_block_m=block_m)  # as TritonTuning pins it
    if prefill_sizes is not None:
        e.runner.prefill_graphs = PrefillGraphs(e.runner, prefill_sizes, DecodeOps(compile=False), full=prefill_full)
        e.runner.prefill_graphs.capture()
    if sampler_sizes is not None:
        e.runner.sampler_graphs = SamplerGraphs(e.runner, sampler_sizes, DecodeOps(compile=False))
        e.runner.sampler_graphs.capture()
    rec = FrameRecorder(e)
    for step in range(5000):
        if step % 4 == 0 and step // 4 < len(reqs):
            e.add_synthesis(reqs[step // 4])
        e.step()
        if step // 4 >= len(reqs) and not e.has_unfinished():
            break
    return e, rec


def test_mixed_prefill_and_decode_steps_replay_the_decode_graph(tiny_model):
    """Decode rows of a mixed step run through the graph, the prefill chunks eagerly: same codes, hiddens."""
    reqs = _requests(5, frames=30)
    _, rec_eager = _run_staggered(tiny_model, reqs, None)
    e, rec_graph = _run_staggered(tiny_model, reqs, [1, 2, 4, 8])
    assert e.runner.timings.mixed_graph_steps >= 4
    assert e.stats()["mixed_graph_steps_total"] == e.runner.timings.mixed_graph_steps
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_graph.frames[seq] == rec_eager.frames[seq]
        np.testing.assert_allclose(rec_graph.hidden(seq), rec_eager.hidden(seq), atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_m", [None, 4])
def test_full_prefill_path_equals_the_eager_forward(tiny_model, block_m):
    """The full prefill graphs' path run eagerly: the static metadata (cu_seqlens_q, seq_lens, block tables,
    slots padded with -1 to the bucket) and the tile table, read by the reference tiled attention, attend as
    GPT.forward does: the same codes, hiddens within 1e-5, with each bucket's BLOCK_M (16, 16, 32) and with 4
    (several tiles a chunk, a last tile partly filled)."""
    reqs = _requests(5, frames=30)
    _, rec_eager = _run_staggered(tiny_model, reqs, None)
    e, rec_full = _run_staggered(
        tiny_model, reqs, [1, 2, 4, 8], prefill_sizes=[5, 16, 24], prefill_full=True, block_m=block_m
    )
    pg = e.runner.prefill_graphs
    assert pg.full and e.runner.timings.prefill_graph_steps >= 5
    assert pg.block_m == ({5: 16, 16: 16, 24: 32} if block_m is None else {5: 4, 16: 4, 24: 4})
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_full.frames[seq] == rec_eager.frames[seq]
        np.testing.assert_allclose(rec_full.hidden(seq), rec_eager.hidden(seq), atol=1e-5, rtol=0)


def test_piecewise_prefill_pieces_equal_the_eager_forward(tiny_model):
    """The piecewise prefill graphs' pieces (run eagerly off CUDA on their static buffers, padded to a token
    bucket, attention between them) against GPT.forward: the same codes and hiddens, decode graphs too."""
    reqs = _requests(5, frames=30)
    _, rec_eager = _run_staggered(tiny_model, reqs, None)
    e, rec_pw = _run_staggered(tiny_model, reqs, [1, 2, 4, 8], prefill_sizes=[5, 16, 24])
    assert e.runner.timings.prefill_graph_steps >= 5 and e.stats()["prefill_graph_steps_total"] > 0
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_pw.frames[seq] == rec_eager.frames[seq]
        np.testing.assert_allclose(rec_pw.hidden(seq), rec_eager.hidden(seq), atol=1e-5, rtol=0)


def test_sampler_graphs_sample_the_first_frames_as_the_eager_path(tiny_model):
    """The general path's code sampling through the sampler graphs' body (off CUDA: run on the static
    buffers, padded to a row bucket with the scratch row): the same codes and hiddens as sample_rows."""
    reqs = _requests(5, frames=30)
    _, rec_eager = _run_staggered(tiny_model, reqs, None)
    e, rec_sg = _run_staggered(tiny_model, reqs, None, sampler_sizes=[2, 8])
    assert e.runner.timings.sampler_graph_steps >= len(reqs)  # every code-sampling step (<= 5 rows, padded to 2 or 8)
    assert e.stats()["sampler_graph_steps_total"] == e.runner.timings.sampler_graph_steps
    for r in reqs:
        seq = f"{r.request_id}/0/code"
        assert rec_sg.frames[seq] == rec_eager.frames[seq]
        np.testing.assert_allclose(rec_sg.hidden(seq), rec_eager.hidden(seq), atol=1e-5, rtol=0)


def test_default_sampler_sizes():
    assert default_sampler_sizes(256) == [1, 2, 4, 8, 16, 32, 64] and default_sampler_sizes(6) == [1, 2, 4, 6]


def test_default_prefill_sizes():
    assert default_prefill_sizes(4096) == [16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert default_prefill_sizes(100) == [16, 32, 64, 96, 100] and default_prefill_sizes(8) == [8]


def test_or_uncompiled_retries_once_with_uncompiled_ops():
    """The graphs' shared fallback (runner/cuda_graphs.or_uncompiled): a failure with compiled ops is retried
    with the same ops uncompiled; a failure without compiled ops, or on the retry, propagates."""
    from types import SimpleNamespace

    from ttsserve.runner.cuda_graphs import or_uncompiled

    owner, calls = SimpleNamespace(ops=SimpleNamespace(compiled=True)), []

    def fails_if_compiled():
        calls.append(owner.ops.compiled)
        if owner.ops.compiled:
            raise RuntimeError("injected")

    or_uncompiled(owner, fails_if_compiled, "test")
    assert calls == [True, False] and not owner.ops.compiled
    with pytest.raises(RuntimeError, match="injected"):
        or_uncompiled(SimpleNamespace(ops=None), lambda: (_ for _ in ()).throw(RuntimeError("injected")), "test")
    with pytest.raises(RuntimeError, match="always"):
        or_uncompiled(
            SimpleNamespace(ops=SimpleNamespace(compiled=True)),
            lambda: (_ for _ in ()).throw(RuntimeError("always")),
            "test",
        )
