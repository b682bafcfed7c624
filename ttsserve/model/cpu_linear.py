"""PackedLinear: a dense linear whose weight is reordered ONCE into oneDNN's blocked layout (CPU only).

`F.linear` on a plain [N, K] weight lets oneDNN / MKL reorder (copy) the weight on every call, and a decode
step is one pass over all weights. Packing once at start-up removes that: the real-size GPT's 80 linears on
2 AVX-512 cores (benchmarks/cpu_kernels.py, load ~1) take, F.linear -> packed, bf16 22.6 -> 18.7 ms at
batch 1 and 35.3 -> 24.3 ms at batch 16; fp32 55.8 -> 37.6 ms at batch 1 and 85.5 -> 31.7 ms at batch 4
(more when other work shares the cores). The result equals F.linear up to summation order.

The packed weight is an opaque `torch._mkldnn` tensor: it cannot be sliced, cast or saved, so packing is
the last thing done to a loaded inference model (ModelRunner start-up), never to a checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linear packing exists for this device / dtype (bf16 only where the CPU has native bf16 dot
    products, AVX512_BF16 or AMX: elsewhere oneDNN emulates bf16 and fp32 is faster)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """AVX512_BF16 or AMX-BF16 (oneDNN's fast bf16 paths)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W packed for oneDNN. x must have the weight's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())  # not a buffer: never saved
        self.bias = None if linear.bias is None else linear.bias.detach().to(w.dtype)
        self.nbytes = w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] in self.dtype -> [..., out_features]."""
        x2 = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pack_linears_(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` (weights on the CPU, packable dtype) by a PackedLinear, in
    place. Returns how many were packed. QuantLinears and anything else are left alone."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and can_pack(child.weight.device, child.weight.dtype):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears_(child)
    return count


def stored_weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's stored tensors: its state_dict (parameters, and the buffers that hold quantized
    weights) plus the packed weights of its PackedLinears, which no state_dict holds."""
    state = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return state + sum(m.nbytes for m in module.modules() if isinstance(m, PackedLinear))
