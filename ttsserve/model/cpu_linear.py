"""PackedLinear: a dense linear whose weight is reordered ONCE into oneDNN's blocked layout (CPU only).

`F.linear` on a plain [N, K] weight lets oneDNN / MKL reorder (copy) the weight on every call, and a decode
step is one pass over all weights. Packing once at start-up removes that: the real-size GPT's 80 linears on
2 AVX-512 cores (benchmarks/cpu_kernels.py, load ~1) take, F.linear -> packed, bf16 22.6 -> 18.7 ms at
batch 1 and 35.3 -> 24.3 ms at batch 16; fp32 55.8 -> 37.6 ms at batch 1 and 85.5 -> 31.7 ms at batch 4
(more when other work shares the cores). The result equals F.linear up to summation order.

DynamicInt8Linear does the same for int8 QuantLinears: their weights prepacked once for fbgemm's W8A8 GEMM.

Packed weights are opaque (a `torch._mkldnn` tensor, an fbgemm packed-params object): they cannot be sliced,
cast or saved, so packing is the last thing done to a loaded inference model (ModelRunner start-up), never
to a checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch import nn

from ttsserve.layers.quant.linear import DenseSize
from ttsserve.platform import cpu_has_native_bf16

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN linear packing exists for this device / dtype (bf16 only where the CPU has native bf16 dot
    products, AVX512_BF16 or AMX: elsewhere oneDNN emulates bf16 and fp32 is faster)."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or cpu_has_native_bf16()


class PackedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W packed for oneDNN. x must have the weight's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, w.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())  # not a buffer: never saved
        self._op = torch.ops.mkldnn._linear_pointwise.default
        self.bias = None if linear.bias is None else linear.bias.detach().to(w.dtype)
        self.nbytes = w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] in self.dtype -> [..., out_features]."""
        if x.dim() == 2 and x.is_contiguous():  # the GPT's [T, in] activations: one op, not four
            return self._op(x, self.packed, self.bias, "none", [], "")
        x2 = x.reshape(-1, self.in_features)
        y = self._op(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pack_linears_(module: nn.Module) -> int:
    """Replace, in place, every nn.Linear inside `module` (weights on the CPU, packable dtype) by a
    PackedLinear, every int8 QuantLinear by a DynamicInt8Linear (where fbgemm is available) and every int4
    one by a PackedInt4Linear (where torch has its CPU int4 kernel). Returns how many were packed."""
    from ttsserve.layers.quant.linear import QuantLinear

    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and can_pack(child.weight.device, child.weight.dtype):
            setattr(module, name, PackedLinear(child))
            count += 1
        elif isinstance(child, QuantLinear) and child.bits == 8 and can_pack_int8(child.qweight.device):
            setattr(module, name, DynamicInt8Linear(child))
            count += 1
        elif isinstance(child, QuantLinear) and child.bits == 4 and can_pack_int4(child):
            setattr(module, name, PackedInt4Linear(child))
            count += 1
        else:
            count += pack_linears_(child)
    return count


# ---- int8 weights x int8 activations (W8A8, dynamic) ---------------------------------------------------------
INT8_KERNEL_ENV = "TTSSERVE_CPU_INT8"  # "w8a8" (default where it is fast and exact enough) | "weight-only"


def can_pack_int8(device: torch.device) -> bool:
    """Serve int8 QuantLinears with fbgemm's dynamic int8 x int8 GEMM (DynamicInt8Linear): on x86 CPUs with
    int8 dot products that accumulate in int32 (VNNI / AMX), unless $TTSSERVE_CPU_INT8 is "weight-only".
    Without VNNI fbgemm must drop activations to 7 bits to avoid int16 saturation, which costs too much
    fidelity (top-1 0.82 against 0.90): those CPUs keep the weight-only kernel."""
    choice = os.environ.get(INT8_KERNEL_ENV, "w8a8")
    if choice not in ("w8a8", "weight-only"):
        raise ValueError(f"${INT8_KERNEL_ENV} must be w8a8 or weight-only, got {choice!r}")
    return (
        choice == "w8a8"
        and device.type == "cpu"
        and torch.backends.quantized.engine in ("x86", "fbgemm")
        and hasattr(torch.ops.quantized, "linear_dynamic")
        and cpu_has_int8_dot()
    )


@functools.cache
def cpu_has_int8_dot() -> bool:
    """AVX512_VNNI, AVX_VNNI or AMX-INT8 in this machine's CPU flags (Linux /proc/cpuinfo; False elsewhere)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


# Wrap calls of ops that take a packed-params script object in this context: their dispatcher asks every
# argument for __torch_function__, and the script object answers by throwing and catching a C++ exception
# (a linear_dynamic call took 10.5 us of overhead, 2.7 with the check off; 80 calls a decode step).
NO_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


class DynamicInt8Linear(DenseSize, nn.Module):
    """An int8 QuantLinear's own weights (no requantization) run by fbgemm's dynamic int8 GEMM (W8A8): each
    call quantizes the activations per tensor to 8-bit unsigned, multiplies int8 x int8 with int32
    accumulation (VNNI) and rescales to fp32. On 2 Zen 4 cores the GPT's 80 linears take 10.1 ms at batch 1
    and 11.9 ms at batch 8, against 13.8 / 38.4 ms for weight-only `torch._weight_int8pack_mm` and 16.6 / 17.0
    ms for packed bf16 (benchmarks/cpu_kernels.py). The price is the activation rounding: docs/benchmarks-history.md has
    the fidelity next to the speed (benchmarks/cpu_parity.py)."""

    def __init__(self, layer) -> None:
        super().__init__()
        import warnings

        self.in_features, self.out_features = layer.in_features, layer.out_features
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # the quantized-tensor constructors warn of their deprecation
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(
                layer.qweight.cpu(), layer.scales.double().cpu(), zero_points, 0
            )
            self.packed = torch.ops.quantized.linear_prepack(qw, None)  # not a buffer: never saved
        # the op's C++ entry point: the torch.ops packet of an op taking a script object (the packed params)
        # first walks every argument in Python for tracing (~2 us a call, 80 calls a step). Call it with
        # __torch_function__ off (NO_TORCH_FUNCTION).
        self._op = torch.ops.quantized.linear_dynamic._op
        self.nbytes = layer.qweight.numel() + layer.scales.numel() * layer.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] float -> [..., out_features] in x's dtype."""
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        with NO_TORCH_FUNCTION():
            y = self._op(x2, self.packed, False)  # 8-bit: VNNI
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 x int8 dynamic"


# ---- int4 weights (awq-int4), bf16 / fp32 activations ---------------------------------------------------------
def can_pack_int4(layer) -> bool:
    """torch's CPU int4 GEMM exists and takes this layer's group size."""
    return (
        layer.qweight.device.type == "cpu"
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        and layer.group_size in (32, 64, 128, 256)
    )


class PackedInt4Linear(DenseSize, nn.Module):
    """An awq-int4 QuantLinear served by `torch._weight_int4pack_mm_for_cpu` (weights unpacked from our
    split-halves layout and repacked once). That kernel computes W = (q - 8) * scale + zero per group, so our
    W = (q - qzero) * scale becomes zero = (8 - qzero) * scale: the same weights, exactly in fp32 (scales are
    fp16), rounded once to bf16 for a bf16 model. On 2 Zen 4 cores the GPT's 80 linears take ~5.6 ms at
    batch 1 against ~10 for W8A8 int8 and ~18 for packed bf16 (benchmarks/cpu_kernels.py --kinds int4);
    QuantLinear's torch fallback dequantized the whole weight on every call."""

    def __init__(self, layer) -> None:
        super().__init__()
        from ttsserve.layers.quant.quantize import unpack_int4

        self.in_features, self.out_features, self.group_size = layer.in_features, layer.out_features, layer.group_size
        q = unpack_int4(layer.qweight, layer.group_size).to(torch.int32)  # [N, K] in 0..15
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # not a buffer: never saved
        scales = layer.scales.float()  # [N, K / G]
        zeros = (8.0 - layer.qzeros.float()) * scales
        self._scale_zero = {torch.float32: torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()}  # [K/G, N, 2]
        self.nbytes = self.packed.numel() * self.packed.element_size() + self._scale_zero[torch.float32].nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] fp32 / bf16 / fp16 -> [..., out_features] in x's dtype."""
        sz = self._scale_zero.get(x.dtype)
        if sz is None:
            sz = self._scale_zero[x.dtype] = self._scale_zero[torch.float32].to(x.dtype)
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, sz)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group_size}, packed"


def stored_weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's stored tensors: its state_dict (parameters, and the buffers that hold quantized
    weights) plus the packed weights of its PackedLinears / DynamicInt8Linears, which no state_dict holds."""
    state = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    packed = PackedLinear | DynamicInt8Linear | PackedInt4Linear
    return state + sum(m.nbytes for m in module.modules() if isinstance(m, packed))
