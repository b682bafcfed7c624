"""The code sampler of sample/sampler.py as one Triton kernel (CUDA): every processor of MODEL.md §4.3 and the
draw, one program per (request, codebook row), no torch.compile.

Why: torch.compile's set-up of the sampler took 10.2 s of an H200 start, and the sampler op by op costs 0.7-1.0
ms more device time per step (7 %) than compiled. This kernel needs neither.

Same results as `sampler.sample` up to float rounding (the reductions sum in another order): the stable ascending
sort of HF's top-p is a sort of int64 keys (the float's order-preserving bits, then the column; with top-k <= 32
only the 32 largest keys are ordered, unless values tie past them), the hash draws
are sample/rng.py's integer math (identical bits), argmax takes the first maximum as torch does. Where a float
sum lands on the top-p threshold a token may differ; tests/gpu/test_triton_sampler.py bounds how often.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ttsserve.sample import sampler
from ttsserve.sample import state as st
from ttsserve.sample.rng import _GOLDEN, _ROW_SALT, _STEP_SALT

# the hash constants of sample/rng.py, as Triton reads module globals
GOLDEN, ROW_SALT, STEP_SALT = tl.constexpr(_GOLDEN), tl.constexpr(_ROW_SALT), tl.constexpr(_STEP_SALT)

MAX_VOCAB = 4096  # one row of logits per program; wider vocabularies (text) take sampler.sample
# Rows whose k_eff <= TOP_WINDOW (ChatTTS's top_k is 20) take the TOP_WINDOW largest keys (a partial bitonic sort)
# instead of sorting all 1,024 (0: always the full sort). H100, us a call (benchmarks/sampler_micro.py), ChatTTS's
# processors at 1 / 256 / 512 requests: full sort at 16 warps 60 / 84 / 161, window at 16 warps 12 / 70 / 139, at
# 4 warps 26 / 46 / 83. One warp count for every batch: a second one per batch size made a variant that the
# start-up's captures did not reach, compiled while serving.
TOP_WINDOW = 32
NUM_WARPS = 4


@triton.jit
def _mul32(x, c: tl.constexpr):
    """(x * c) mod 2**32 for int64 x in [0, 2**32), as rng._mul32 (c >= 2**31 used as c - 2**32)."""
    if c >= 2147483648:
        return (x * (c - 4294967296)) & 0xFFFFFFFF
    return (x * c) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    """rng.mix32 on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def _key_values(skeys):
    """The fp32 values of sort keys (padding keys: -inf)."""
    sbits = (skeys >> 32).to(tl.int32)
    sbits = sbits ^ ((sbits >> 31) & 0x7FFFFFFF)
    svals = sbits.to(tl.float32, bitcast=True)
    return tl.where(skeys >> 32 == -2147483648, -float("inf"), svals)


@triton.jit
def _cut_sorted(keys, v, threshold, k_eff, BLOCK: tl.constexpr):
    """(first_kept, kth) from all BLOCK keys sorted ascending, HF's order: top-p removes the prefix whose
    cumulative probability is <= threshold (never the top 3), top-k every value below the k_eff-th largest."""
    skeys = tl.sort(keys, 0)
    svals = _key_values(skeys)
    sp = tl.exp(svals - tl.max(svals, 0))
    cum = tl.cumsum(sp / tl.sum(sp, 0), 0)
    remove_sorted = (cum <= threshold) & (v < BLOCK - 3)  # HF keeps at least 3 tokens
    n_removed = tl.sum(remove_sorted.to(tl.int32), 0)  # a prefix: cum never decreases
    first_kept = tl.sum(tl.where(v == n_removed, skeys, 0), 0)
    kth_pos = BLOCK - k_eff
    kth = tl.sum(tl.where(v == kth_pos, svals, 0.0), 0)
    kth = tl.where(kth_pos < n_removed, -float("inf"), kth)
    return first_kept, kth


@triton.jit
def _cut_in_window(x, keys, threshold, k_eff, WINDOW: tl.constexpr):
    """_cut_sorted from the WINDOW largest keys only (k_eff <= WINDOW): a partial bitonic sort instead of the full
    one. A token's ascending cumulative probability is 1 - (the mass above it), so the window's own prefix sums
    decide top-p inside it. Returns cut = 0 where the window cannot decide: nothing in it is removed by top-p and
    its last value ties the k-th (tokens outside it, equal to the k-th, keep or lose by top-p)."""
    tk = tl.topk(keys, WINDOW)  # descending
    tv = _key_values(tk)
    d = tl.arange(0, WINDOW)
    m = tl.max(x, 0)
    denom = tl.sum(tl.exp(x - m), 0)
    e = tl.exp(tv - m)
    cum = (denom - (tl.cumsum(e, 0) - e)) / denom  # ascending cumulative probability at each window position
    n_kept = tl.sum(((cum > threshold) | (d < 3)).to(tl.int32), 0)  # a prefix of the window: cum falls with d
    first_kept = tl.sum(tl.where(d == n_kept - 1, tk, 0), 0)
    kth = tl.sum(tl.where(d == k_eff - 1, tv, 0.0), 0)
    last = tl.sum(tl.where(d == WINDOW - 1, tv, 0.0), 0)
    cut = ((n_kept < WINDOW) | (last < kth)).to(tl.int32)
    return first_kept, kth, cut


@triton.jit
def _draw(
    x,
    v,
    r,
    temp,
    pen,
    hist_ptr,
    stride_hw,
    window,
    top_p,
    top_k,
    banned,
    greedy,
    seed,
    step,
    vocab,
    eos_id,
    BLOCK: tl.constexpr,
    TOP_WINDOW: tl.constexpr,
):
    """The token of one (request, codebook row r): x [BLOCK] its fp32 logits (0 past vocab), v = arange(BLOCK);
    temp / pen fp32, top_p fp64, top_k int64, banned / greedy bool, seed / step int64 scalars; the history is
    `window` int64 tokens at hist_ptr + w * stride_hw (-1 where absent)."""
    real = v < vocab
    x = x / temp
    # repetition penalty: alpha = penalty ** count, by repeated products (count <= window, small)
    alpha = tl.full([BLOCK], 1.0, tl.float32)
    for w in range(window):
        tok = tl.load(hist_ptr + w * stride_hw)
        alpha = tl.where(v == tok, alpha * pen, alpha)
    x = tl.where(x < 0, x * alpha, x / alpha)
    x = tl.where(real, x, -float("inf"))

    # top-p then top-k on the stable ascending order: keys = order-preserving bits << 32 | column, the padding
    # columns first (below every real key), so the real values hold the last `vocab` positions
    xz = x + 0.0  # -0.0 sorts as +0.0 (torch's order)
    bits = xz.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    hi = tl.where(real, bits.to(tl.int64), -2147483648)
    keys = (hi << 32) | v.to(tl.int64)
    threshold = (1.0 - top_p.to(tl.float64)).to(tl.float32)
    k_eff = tl.minimum(tl.maximum(top_k, 3), vocab).to(tl.int32)
    # the kept tokens are (keys >= first_kept) & (x >= kth); first_kept is a key, kth a value
    first_kept = tl.full([], 0, tl.int64)  # placeholders: a cut below sets both
    kth = tl.full([], -float("inf"), tl.float32)
    cut = tl.full([], 0, tl.int32)
    if TOP_WINDOW > 0:
        if k_eff <= TOP_WINDOW:
            first_kept, kth, cut = _cut_in_window(x, keys, threshold, k_eff, TOP_WINDOW)
    if cut == 0:
        first_kept, kth = _cut_sorted(keys, v, threshold, k_eff, BLOCK)
    x = tl.where((keys < first_kept) | (x < kth), -float("inf"), x)
    x = tl.where((v == eos_id) & banned, -float("inf"), x)

    # the draw: argmax(probs / -log(u)), u = rng.hash_uniform(seed, step, r, v); greedy rows: argmax(x)
    h = _mix32((seed & 0xFFFFFFFF) ^ GOLDEN)
    h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF))
    h = _mix32(h ^ _mul32(step & 0xFFFFFFFF, STEP_SALT))
    key = _mix32(h ^ _mul32((r + 1).to(tl.int64), ROW_SALT))
    hv = _mix32(key ^ v.to(tl.int64))
    hv = _mix32(hv ^ GOLDEN)
    u = ((hv >> 9).to(tl.float32) + 0.5) * (2.0**-23)
    e = tl.exp(x - tl.max(x, 0))
    probs = e / tl.sum(e, 0)
    race = tl.where(real, probs / -tl.log(u), -1.0)
    return tl.where(greedy, tl.argmax(x, 0), tl.argmax(race, 0)).to(tl.int64)


@triton.jit
def _sample_kernel(
    out_ptr,
    logits_ptr,
    temp_ptr,
    top_p_ptr,
    top_k_ptr,
    pen_ptr,
    hist_ptr,
    banned_ptr,
    greedy_ptr,
    seed_ptr,
    step_ptr,
    stride_lb,
    stride_lr,
    stride_tb,
    stride_p,
    stride_k,
    stride_pen,
    stride_ban,
    stride_greedy,
    stride_seed,
    stride_step,
    stride_hb,
    stride_hr,
    stride_hw,
    num_rows,
    vocab,
    window,
    eos_id,
    BLOCK: tl.constexpr,
    TOP_WINDOW: tl.constexpr,
):
    """Grid (B * R,): tokens[b, r] for logits[b, r, :vocab]; BLOCK = next power of two >= vocab. The [B]
    parameters may be strided (columns of the engine's per-row parameter tables: sample/state.py)."""
    pid = tl.program_id(0)
    b, r = pid // num_rows, pid % num_rows
    b = b.to(tl.int64)
    v = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + b * stride_lb + r * stride_lr + v, mask=v < vocab, other=0.0).to(tl.float32)
    token = _draw(
        x,
        v,
        r,
        tl.load(temp_ptr + b * stride_tb + r),
        tl.load(pen_ptr + b * stride_pen),
        hist_ptr + b * stride_hb + r * stride_hr,
        stride_hw,
        window,
        tl.load(top_p_ptr + b * stride_p),
        tl.load(top_k_ptr + b * stride_k),
        tl.load(banned_ptr + b * stride_ban) != 0,
        tl.load(greedy_ptr + b * stride_greedy) != 0,
        tl.load(seed_ptr + b * stride_seed),
        tl.load(step_ptr + b * stride_step),
        vocab,
        eos_id,
        BLOCK,
        TOP_WINDOW,
    )
    tl.store(out_ptr + pid, token)


@triton.jit
def _sample_record_kernel(
    out_ptr,
    logits_ptr,
    rows_ptr,
    steps_ptr,
    fparams_ptr,
    iparams_ptr,
    ring_ptr,
    last_ptr,
    stride_lb,
    stride_lr,
    stride_f,
    stride_i,
    stride_rb,
    stride_rr,
    stride_rw,
    stride_last,
    num_rows,
    vocab,
    window,
    eos_id,
    TOP_P: tl.constexpr,
    PENALTY: tl.constexpr,
    TEMPERATURE: tl.constexpr,
    TOP_K: tl.constexpr,
    GREEDY: tl.constexpr,
    SEED: tl.constexpr,
    MIN_NEW: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
    TOP_WINDOW: tl.constexpr,
):
    """Grid (B * R,): _sample_kernel for the state rows rows[b] at steps[b], reading SamplingState's tables
    directly (its batch(): float64 parameters rounded to fp32 as torch's .float() rounds them), then its record():
    the token into the row's ring at step % its window and into last_tokens. Each program writes only the ring
    slice it read (its own (row, r)); padding rows share the scratch row, whose contents nothing reads."""
    pid = tl.program_id(0)
    b, r = pid // num_rows, pid % num_rows
    b = b.to(tl.int64)
    row = tl.load(rows_ptr + b)
    step = tl.load(steps_ptr + b)
    fp, ip = fparams_ptr + row * stride_f, iparams_ptr + row * stride_i
    hist = ring_ptr + row * stride_rb + r * stride_rr
    v = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + b * stride_lb + r * stride_lr + v, mask=v < vocab, other=0.0).to(tl.float32)
    token = _draw(
        x,
        v,
        r,
        tl.load(fp + TEMPERATURE + r).to(tl.float32),
        tl.load(fp + PENALTY).to(tl.float32),
        hist,
        stride_rw,
        window,
        tl.load(fp + TOP_P),
        tl.load(ip + TOP_K),
        step < tl.load(ip + MIN_NEW),
        tl.load(ip + GREEDY) != 0,
        tl.load(ip + SEED),
        step,
        vocab,
        eos_id,
        BLOCK,
        TOP_WINDOW,
    )
    tl.store(out_ptr + pid, token)
    tl.store(hist + (step % tl.load(ip + WINDOW)) * stride_rw, token)
    tl.store(last_ptr + row * stride_last + r, token)


def can_sample(logits: torch.Tensor) -> bool:
    return logits.is_cuda and logits.shape[-1] <= MAX_VOCAB


def sample(logits: torch.Tensor, batch, num_warps: int = NUM_WARPS, top_window: int = TOP_WINDOW) -> torch.Tensor:
    """sampler.sample for CUDA logits [B, R, V] (V <= MAX_VOCAB) and a SamplingBatch on the same device ->
    tokens [B, R] int64. No host sync (graph-capturable)."""
    b, r, v = logits.shape
    out = torch.empty(b, r, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    assert logits.stride(-1) == 1 and batch.temperature.stride(-1) == 1
    assert top_window & (top_window - 1) == 0, "the window is a power of two (tl.topk)"
    hist = batch.history
    _sample_kernel[(b * r,)](
        out,
        logits,
        batch.temperature,
        batch.top_p,
        batch.top_k,
        batch.repetition_penalty,
        hist,
        batch.eos_banned,
        batch.greedy,
        batch.seeds,
        batch.steps,
        logits.stride(0),
        logits.stride(1),
        batch.temperature.stride(0),
        batch.top_p.stride(0),
        batch.top_k.stride(0),
        batch.repetition_penalty.stride(0),
        batch.eos_banned.stride(0),
        batch.greedy.stride(0),
        batch.seeds.stride(0),
        batch.steps.stride(0),
        hist.stride(0),
        hist.stride(1),
        hist.stride(2),
        r,
        v,
        hist.shape[2],
        batch.eos_id,
        BLOCK=triton.next_power_of_2(v),
        TOP_WINDOW=min(top_window, triton.next_power_of_2(v)) if top_window else 0,
        num_warps=num_warps,
    )
    return out


def sample_and_record(
    logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor, eos_id: int, num_warps: int = NUM_WARPS
) -> torch.Tensor:
    """sample(logits, state.batch(rows, steps, R, eos_id)) then state.record(rows, steps, tokens) as one kernel:
    the ~11 gathers, casts and scatters of batch() and record() (each a kernel and a launch gap of a decode graph)
    read and written by the sampler itself. logits: CUDA [B, R, V] (can_sample); state: a SamplingState on the
    same device; rows / steps: int64 [B]. Returns tokens [B, R] int64; no host sync (graph-capturable)."""
    b, r, v = logits.shape
    out = torch.empty(b, r, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    fp, ip, ring, last = state.fparams, state.iparams, state.ring, state.last_tokens
    assert logits.stride(-1) == 1 and fp.stride(1) == ip.stride(1) == last.stride(1) == 1 and r <= state.num_vq
    _sample_record_kernel[(b * r,)](
        out,
        logits,
        rows,
        steps,
        fp,
        ip,
        ring,
        last,
        logits.stride(0),
        logits.stride(1),
        fp.stride(0),
        ip.stride(0),
        ring.stride(0),
        ring.stride(1),
        ring.stride(2),
        last.stride(0),
        r,
        v,
        ring.shape[2],
        eos_id,
        TOP_P=st._TOP_P,
        PENALTY=st._PENALTY,
        TEMPERATURE=st._TEMPERATURE,
        TOP_K=st._TOP_K,
        GREEDY=st._GREEDY,
        SEED=st._SEED,
        MIN_NEW=st._MIN_NEW,
        WINDOW=st._WINDOW,
        BLOCK=triton.next_power_of_2(v),
        TOP_WINDOW=min(TOP_WINDOW, triton.next_power_of_2(v)),
        num_warps=num_warps,
    )
    return out


def sample_or_reference(logits: torch.Tensor, batch) -> torch.Tensor:
    """sample() where it applies (CUDA, the code vocabulary), else sampler.sample."""
    return (sample if can_sample(logits) else sampler.sample)(logits, batch)


def sample_and_record_or_reference(
    logits: torch.Tensor, state, rows: torch.Tensor, steps: torch.Tensor, eos_id: int
) -> torch.Tensor:
    """sample_and_record() where the kernel applies (CUDA, the code vocabulary), else sampler.sample and
    state.record op by op."""
    if can_sample(logits):
        return sample_and_record(logits, state, rows, steps, eos_id)
    return sampler.sample_and_record(sampler.sample, logits, state, rows, steps, eos_id)
