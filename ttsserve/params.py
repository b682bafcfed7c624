"""Per-request sampling parameters, validated at the library boundary (InvalidRequestError on bad values)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

NUM_VQ = 4


class InvalidRequestError(ValueError):
    """A request the engine refuses as given (the caller's fault; the server's 400).

    param: the request field at fault (a SynthesisRequest / SamplingParams field name such as "text" or
    "temperature", or "request_id"), None when no single field is. Defined in this bottom module so that
    params and text checks can raise it; engine/errors.py re-exports it with the other engine errors.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """ChatTTS sampling semantics (MODEL.md §4.2-4.3), per request.

    temperature: a float, or one value per codebook (code stage only).
    top_p / top_k: HF warpers with min_tokens_to_keep=3 (top_k=1 behaves as top-3, as in the reference).
    repetition_penalty: frequency penalty rp**count over the last `repetition_window` generated tokens
        of each (request, codebook) row; 1.0 disables it.
    min_new_tokens: EOS is banned while fewer tokens than this were generated.
    max_new_tokens: hard cap; hitting it marks the result `finish_reason="length"`.
    seed: a seeded request gives the same tokens whatever else is in the batch and across preemption.
        None means the engine draws a seed at admission (still preemption-invariant).
    greedy: argmax over the penalized, EOS-banned logits (the golden vectors' "greedy" mode).
    """

    temperature: float | tuple[float, ...] = 0.3
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.05
    repetition_window: int = 16
    min_new_tokens: int = 0
    max_new_tokens: int = 2048
    seed: int | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        temps = self.temperatures(NUM_VQ)
        if any(not (t > 0.0) or t != t for t in temps):
            raise InvalidRequestError(f"temperature must be > 0, got {self.temperature!r}", "temperature")
        if isinstance(self.temperature, tuple) and len(self.temperature) not in (1, NUM_VQ):
            raise InvalidRequestError(
                f"temperature list must have 1 or {NUM_VQ} values, got {len(self.temperature)}", "temperature"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 1:
            raise InvalidRequestError(f"top_k must be >= 1, got {self.top_k}", "top_k")
        if not (self.repetition_penalty > 0.0):
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty"
            )
        if self.repetition_window < 1:
            raise InvalidRequestError(
                f"repetition_window must be >= 1, got {self.repetition_window}", "repetition_window"
            )
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}", "max_new_tokens")
        if not (0 <= self.min_new_tokens <= self.max_new_tokens):
            raise InvalidRequestError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
                "min_new_tokens",
            )
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}", "seed")

    def temperatures(self, num_rows: int) -> tuple[float, ...]:
        """Temperature per codebook row (num_rows = NUM_VQ for code, 1 for text)."""
        t = self.temperature
        if isinstance(t, (int, float)):
            return (float(t),) * num_rows
        t = tuple(float(x) for x in t)
        return t * num_rows if len(t) == 1 else t[:num_rows] if num_rows == 1 else t

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    @classmethod
    def code_defaults(cls, **overrides) -> SamplingParams:
        """InferCodeParams defaults of the reference (MODEL.md §4.1)."""
        return cls(**overrides)

    @classmethod
    def refine_defaults(cls, **overrides) -> SamplingParams:
        """RefineTextParams defaults of the reference (MODEL.md §4.1)."""
        base = dict(temperature=0.7, top_p=0.7, top_k=20, repetition_penalty=1.0, max_new_tokens=384)
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True)
class Voice:
    """Who speaks. All fields optional; an empty Voice is ChatTTS's `[empty_spk]`.

    spk_emb: the speaker vector, float16 numpy array [hidden_size] (decoded from a ChatTTS speaker string or
        sampled from `spk_stat` with a seed).
    spk_smp: an audio-code prompt, int32 numpy array [num_vq, P] (DVAE-encoded reference recording).
    txt_smp: the transcript of that reference recording (goes before the text in the code prompt).
    name: for logs only.
    """

    spk_emb: object | None = None
    spk_smp: object | None = None
    txt_smp: str | None = None
    name: str = ""

    @property
    def key(self) -> str:
        """A stable identity for prefix-cache hashing (equal voices share prompt KV blocks)."""
        import hashlib

        h = hashlib.sha1()
        for part in (self.spk_emb, self.spk_smp):
            h.update(b"-" if part is None else bytes(memoryview(part).cast("B")))
        h.update((self.txt_smp or "").encode())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class SynthesisRequest:
    """One utterance (any length: long text is split into segments inside the engine front end).

    refine_text: run ChatTTS's refine-text stage first (adds [uv_break] etc.); skipped by default like the
        reference's OpenAI example, since it costs up to 384 sequential steps before any audio.
    refine_prompt: sentence-level control tokens for the refine stage, e.g. "[oral_2][laugh_0][break_6]".
    code_prompt: the code-stage prompt, e.g. "[speed_5]".
    normalize: the extended text normalization (numbers, dates, units ...); False gives the reference rules.
    split: split long text into sentence-sized segments synthesized in parallel.
    raw_text: the text goes into the prompt exactly as given (already normalized or refined): no
        normalization and no splitting.
    """

    text: str
    voice: Voice = Voice()
    code_params: SamplingParams = SamplingParams()
    refine_text: bool = False
    refine_params: SamplingParams = SamplingParams.refine_defaults()
    refine_prompt: str = ""
    code_prompt: str = "[speed_5]"
    normalize: bool = True
    split: bool = True
    raw_text: bool = False
    request_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text.strip():
            raise InvalidRequestError("text must be a non-empty string", "text")
