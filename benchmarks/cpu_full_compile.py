"""Experiment: the whole CPU decode step of the GPT (20 layers, paged KV write and attention) as ONE
torch.compile graph with inductor freezing, against the same code eager.

    OMP_WAIT_POLICY=ACTIVE python3 benchmarks/cpu_full_compile.py eager|compiled [int4]

Real-size dummy GPT in bf16, plain (unpacked) weights: freezing lets inductor fold and prepack them; the
engine's eager path packs them itself (model/cpu_linear.py), and its PackedLinear cannot be traced. Prints
the compile time and ms per step at batch 1 and 8 (context 200). Not wired into the engine: see
docs/benchmarks-history.md (CPU fast path) for the figures and why. With `int4`, the GPT is quantized to
awq-int4 and its linears are the engine's PackedInt4Linear (torch's CPU int4 GEMM, traceable): no freezing is needed.
"""

import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
from ttsserve.attention.torch_ref import paged_decode_attention
from ttsserve.config import EngineConfig
from ttsserve.model.chattts import build_model, read_checkpoint

ckpt = read_checkpoint(EngineConfig(load_format="dummy", dummy_size="real"))
INT4 = "int4" in sys.argv[2:]
model = build_model(ckpt, torch.device("cpu"), torch.bfloat16, quantization="awq-int4" if INT4 else None)
gpt = model.gpt.eval()
if INT4:
    from ttsserve.model.cpu_linear import pack_linears_

    pack_linears_(gpt)


def lin(module, x):
    return module(x) if INT4 else F.linear(x, module.weight)


cfg = gpt.cfg
H, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
NB, BS = 400, 16
caches = [torch.zeros(2, NB, BS, nkv, d, dtype=torch.bfloat16) for _ in range(cfg.num_layers)]
cos_t, sin_t = gpt.rotary.cos_cached, gpt.rotary.sin_cached


def rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rot(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def step(x, positions, slots, tables, seq_lens):
    b = x.shape[0]
    cos = cos_t[positions][:, None, :].to(x.dtype)
    sin = sin_t[positions][:, None, :].to(x.dtype)
    h = x
    for i, layer in enumerate(gpt.layers):
        qkv = lin(layer.qkv_proj, rms(h, layer.input_layernorm.weight, layer.input_layernorm.eps))
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = rot(q.reshape(b, nh, d), cos, sin)
        k = rot(k.reshape(b, nkv, d), cos, sin)
        v = v.reshape(b, nkv, d)
        c = caches[i]
        c.view(2, NB * BS, nkv, d).index_copy_(1, slots, torch.stack((k, v)))
        attn = paged_decode_attention(q.float(), c[0], c[1], tables, seq_lens, d**-0.5).to(x.dtype)
        h = h + lin(layer.o_proj, attn.reshape(b, nh * d))
        gu = lin(layer.gate_up_proj, rms(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps))
        g, u = gu.chunk(2, dim=-1)
        h = h + lin(layer.down_proj, F.silu(g) * u)
    return rms(h, gpt.norm.weight, gpt.norm.eps)


def inputs(b, ctx):
    nb = -(-ctx // BS)
    tables = torch.arange(b * nb, dtype=torch.int32).view(b, nb) % NB
    pos = torch.full((b,), ctx - 1, dtype=torch.long)
    slots = tables[:, -1].long() * BS + (ctx - 1) % BS
    return torch.randn(b, H, dtype=torch.bfloat16), pos, slots, tables, torch.full((b,), ctx, dtype=torch.int32)


mode = sys.argv[1]
if mode == "compiled":
    import torch._inductor.config as ic

    ic.freezing = not INT4
    with torch.inference_mode():
        step(*inputs(1, 40))  # eager once: fills lazily built per-dtype tables before tracing
    fn = torch.compile(step, dynamic=True)
else:
    fn = step
with torch.inference_mode():
    t = time.perf_counter()
    for b, ctx in ((1, 80), (3, 97)):
        fn(*inputs(b, ctx))
    print(mode, "warm/compile", round(time.perf_counter() - t, 1), "s")
    for b, ctx in ((1, 200), (8, 200)):
        args = inputs(b, ctx)
        for _ in range(3):
            fn(*args)
        t = time.perf_counter()
        for _ in range(20):
            fn(*args)
        print(mode, f"b={b} ctx={ctx}", round((time.perf_counter() - t) / 20 * 1e3, 2), "ms")
