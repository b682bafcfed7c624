"""ttsserve: a vLLM-style serving engine for ChatTTS.

`import ttsserve` works on any machine; CUDA-only modules are imported lazily by the GPU paths.
"""

from ttsserve.constants import VERSION as __version__  # noqa: F401 (re-exported)


def __getattr__(name: str):
    # Lazy re-exports keep `import ttsserve` cheap (no torch import until needed).
    if name == "TTS":
        from ttsserve.entrypoints.tts import TTS

        return TTS
    if name == "SamplingParams":
        from ttsserve.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
