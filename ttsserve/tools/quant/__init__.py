"""The offline quantization tools: calibrate.py (activation statistics and the AWQ scale search), cli.py
(`ttsserve quantize`), quality.py (`ttsserve bench quality`). The formats and kernels are layers/quant/."""
