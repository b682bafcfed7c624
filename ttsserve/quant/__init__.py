"""Quantization of the ChatTTS GPT: weight-only int8 / AWQ-style int4 linears and an fp8 KV cache.

- quantize.py: the number formats (per-channel int8, group-wise asymmetric int4 with packing), the
  `QuantConfig` written beside a quantized checkpoint, and quantizing a GPT state dict.
- linear.py: `QuantLinear`, the module that replaces the GPT's nn.Linear layers, and the torch (CPU)
  kernels; triton_quant.py holds the CUDA kernels (imported only on CUDA).
- calibrate.py: activation statistics from the calibration corpus and the AWQ scale search.
- kv_fp8.py: the fp8 (e4m3) KV cache layout with per-token, per-head scales, and its torch reference.
- memory.py: what quantization saved at start-up; quality.py: `ttsserve bench quality`; cli.py:
  `ttsserve quantize`.
"""
