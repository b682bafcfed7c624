"""The decode step's small fused ops as Triton kernels (CUDA): RMSNorm, residual add + RMSNorm, SiLU-and-mul and
the q / k RoPE of the piecewise prefill graphs. They replace torch.compile's fusion of the same functions
(runner/decode_ops.py's _rmsnorm, ...): the same kernels once fused, without tracing them at every start
(torch.compile's set-up took 13.1 s of a 39-s H200 cold start with its caches warm; a cached Triton kernel
loads in milliseconds).

Arithmetic, per row of x (x's dtype, bf16 on the GPU, or any float dtype):
- rmsnorm: y = x / sqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then weight * y rounded once;
- add_rmsnorm: s = residual + x rounded to x's dtype (the residual stream stays in x's dtype), then rmsnorm(s);
- silu_mul: silu(gate) rounded to x's dtype, times up, rounded once (torch's op-by-op result);
- rope: x * cos + rotate_half(x) * sin in fp32 from x, cos, sin, rounded once;
- embed_rows: the decode input of each row, sum over codebooks q (in order) of emb_code[q, last_tokens[row, q]] in
  fp32, rounded once to the GPT dtype (Embed.embed_codes then .to(dtype), in one kernel instead of five).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_sum,
    n,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: out[row] = rmsnorm(x[row] (+ res[row])) and, with HAS_RES, sum[row] = x + res."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype
        )
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(x.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(n, BLOCK)): out[row, c] = silu(gu[row, c]) * gu[row, n + c]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_cos,
    stride_sin,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
):
    """Grid (tokens, heads): out[t, h] = x[t, h] * cos[t] + rotate_half(x[t, h]) * sin[t]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    base = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(base + d)
    partner = tl.load(base + (d + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)
    partner = tl.where(d < HEAD_DIM // 2, -partner, partner)
    cos = tl.load(cos_ptr + t * stride_cos + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + d).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (x.to(tl.float32) * cos + partner * sin).to(x.dtype))


@triton.jit
def _embed_rows_kernel(
    emb_ptr,
    last_ptr,
    rows_ptr,
    out_ptr,
    stride_eq,
    stride_ev,
    stride_last,
    stride_out,
    n,
    Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row b: out[b] = sum_q emb[q, last[rows[b], q]] (fp32, q ascending), in out's dtype."""
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    acc = tl.zeros([BLOCK], tl.float32)
    for q in tl.static_range(Q):
        tok = tl.load(last_ptr + row * stride_last + q)
        acc += tl.load(emb_ptr + q * stride_eq + tok * stride_ev + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, n] with a unit column stride (a view when it already is one)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_norm(x2, r2, weight, out, total, eps: float, has_res: bool) -> None:
    """_rmsnorm_kernel over the rows of x2 [T, n] (and r2, summed into total, with has_res) into out."""
    if x2.shape[0]:
        n = x2.shape[1]
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            out,
            total,
            x2.stride(0),
            r2.stride(0) if has_res else 0,
            out.stride(0),
            total.stride(0) if has_res else 0,
            n,
            eps,
            HAS_RES=has_res,
            BLOCK=triton.next_power_of_2(n),
        )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] -> rmsnorm(x) * weight, [..., n] in x's dtype (a new contiguous tensor)."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_norm(x2, x2, weight, out, out, eps, has_res=False)
    return out.view(x.shape)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) * weight, residual + x), both [..., n] in x's dtype."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out)
    _launch_norm(x2, r2, weight, out, total, eps, has_res=True)
    return out.view(x.shape), total.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2n] -> silu(gate_up[..., :n]) * gate_up[..., n:], [..., n]."""
    g2 = _rows(gate_up)
    n = g2.shape[1] // 2
    out = torch.empty(g2.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, out, g2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) * D] (unit column stride), cos / sin [T, 1, D] -> q [T, Hq, D] and k [T, Hkv, D]
    rotated (views of one new [T, Hq + Hkv, D] tensor) and v [T, Hkv, D] (a view of qkv)."""
    t, heads = qkv.shape[0], num_heads + num_kv_heads
    qk = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
        _rope_kernel[(t, heads)](
            qkv,
            cos,
            sin,
            qk,
            qkv.stride(0),
            head_dim,
            cos.stride(0),
            sin.stride(0),
            qk.stride(0),
            qk.stride(1),
            HEAD_DIM=head_dim,
        )
    v = qkv[:, heads * head_dim :].reshape(t, num_kv_heads, head_dim)
    return qk[:, :num_heads], qk[:, num_heads:], v


def embed_rows(
    emb_code: torch.Tensor, last_tokens: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """emb_code [Q, V, H], last_tokens [N, Q] int64, rows [B] int64 -> [B, H] in `dtype`: the code embedding of
    each row's last frame (Embed.embed_codes(last_tokens[rows]).to(dtype))."""
    q, _, h = emb_code.shape
    b = rows.shape[0]
    out = torch.empty(b, h, dtype=dtype, device=emb_code.device)
    assert emb_code.stride(2) == 1 and last_tokens.stride(1) == 1 and last_tokens.shape[1] >= q
    if b:
        _embed_rows_kernel[(b,)](
            emb_code,
            last_tokens,
            rows,
            out,
            emb_code.stride(0),
            emb_code.stride(1),
            last_tokens.stride(0),
            out.stride(0),
            h,
            Q=q,
            BLOCK=triton.next_power_of_2(h),
        )
    return out
