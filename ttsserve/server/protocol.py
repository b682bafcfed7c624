"""HTTP schemas (pydantic) and their mapping onto the engine's SynthesisRequest.

`POST /v1/audio/speech` follows OpenAI's speech API; ChatTTS extras (seed, temperature, top_p, top_k,
repetition_penalty, max_new_tokens, refine_text, prompt, sample_rate, normalize) sit in the same body.
Unknown top-level fields of the two synthesis bodies are accepted, as vLLM accepts them (clients such as
Open WebUI and Home Assistant let users add extra parameters): the server logs each unknown field name once
and names them in the response's X-Ignored-Fields header (server/compat.py); `--strict-request-fields`
turns them back into a 400 naming the field. Nested objects (a voice object) stay strict.

`instructions` (free text in OpenAI's API): ChatTTS has no instruction-following model, so only the ChatTTS
sentence-level control tokens found in it are used, `[oral_0-9]`, `[laugh_0-2]`, `[break_0-7]`, as the
refine prompt (which turns on the refine-text stage); all other text in it is ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ttsserve.audio.encode import SAMPLE_RATES
from ttsserve.audio.speed import speed_to_prompt, speed_token
from ttsserve.constants import SAMPLE_RATE
from ttsserve.params import SamplingParams, SynthesisRequest, Voice

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
REFINE_TOKEN_RE = re.compile(r"\[(?:oral_[0-9]|laugh_[0-2]|break_[0-7])\]")
REFINE_PROMPT_RE = re.compile(r"^(?:\[(?:oral_[0-9]|laugh_[0-2]|break_[0-7])\])*$")
MAX_SEED = 2**63 - 1
VOICE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 _.\-]{0,63}$"
# Text with something to speak: a Latin letter or digit, or a CJK character (others are normalized away).
SPEAKABLE_PATTERN = "[A-Za-z0-9\u4e00-\u9fff]"
_SPEAKABLE = {"pattern": SPEAKABLE_PATTERN}


def _whole_number(v):
    """1.0 -> 1: JSON Schema's integer includes numbers with a zero fraction; other floats stay (and fail)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _int(ge: int, le: int):
    """An integer field type of a strict model, in [ge, le], that accepts 1.0 as JSON Schema does."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_whole_number)]


class _Strict(BaseModel):
    # strict: no silent coercion ("seed": false is not 0, "speed": "2" is not 2.0); ints still pass as floats
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def _exactly_one_of(fields: dict[str, dict]) -> dict:
    """JSON Schema for "exactly one of these fields is given (non-null)": one oneOf branch per field."""
    return {"oneOf": [{"required": [name], "properties": {name: schema}} for name, schema in fields.items()]}


class VoiceRef(_Strict):
    """A voice given as an object: exactly one of `id` (a stored or built-in voice), `seed` (a random
    ChatTTS speaker drawn with that seed) or `speaker` (a ChatTTS speaker string)."""

    model_config = ConfigDict(
        json_schema_extra=_exactly_one_of(
            {"id": {"type": "string"}, "seed": {"type": "integer"}, "speaker": {"type": "string"}}
        )
    )

    id: str | None = Field(None, min_length=1, max_length=128)
    seed: _int(0, 2**32 - 1) | None = Field(None)
    speaker: str | None = Field(None, min_length=1, max_length=16384)

    @model_validator(mode="after")
    def _exactly_one(self) -> VoiceRef:
        if sum(v is not None for v in (self.id, self.seed, self.speaker)) != 1:
            raise ValueError("give exactly one of id, seed, speaker")
        return self


VoiceName = Annotated[str, Field(min_length=1, max_length=128)]
VoiceSpec = VoiceName | VoiceRef


class ChatTTSOptions(_Strict):
    """ChatTTS extras; None means the engine default (SamplingParams.code_defaults())."""

    seed: _int(0, MAX_SEED) | None = Field(None, description="sampling seed: same seed, same audio")
    temperature: float | None = Field(None, gt=0, le=5)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: _int(1, 1024) | None = Field(None)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    max_new_tokens: _int(1, 1 << 20) | None = Field(None, description="frame cap per text segment")
    min_new_tokens: _int(0, 1 << 20) | None = Field(None, description="EOS is banned before this many frames")
    refine_text: bool | None = Field(None, description="run the refine-text stage (default: on iff a prompt is given)")
    prompt: str | None = Field(
        None,
        max_length=256,
        description="refine prompt of [oral_0-9][laugh_0-2][break_0-7] tokens",
        json_schema_extra={"pattern": REFINE_PROMPT_RE.pattern},
    )
    sample_rate: _int(0, 1 << 30) | None = Field(
        None,
        description=f"output rate, one of {SAMPLE_RATES}; default {SAMPLE_RATE}",
        json_schema_extra={"enum": [*SAMPLE_RATES, None]},
    )
    normalize: bool | None = Field(None, description="extended text normalization (numbers, units, ...)")
    volume_multiplier: float = Field(
        1.0, ge=0, le=10, description="gain applied to the samples (clipped to [-1, 1]); 1 = unchanged"
    )
    lang_code: str | None = Field(
        None,
        max_length=16,
        description="Kokoro's language hint; ChatTTS reads the language from the text, so it is ignored "
        "(and named in X-Ignored-Fields)",
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_tokens(cls, v: str | None) -> str | None:
        if v is not None and not REFINE_PROMPT_RE.match(v):
            raise ValueError("prompt must be a sequence of [oral_0-9], [laugh_0-2], [break_0-7] tokens")
        return v

    @field_validator("sample_rate")
    @classmethod
    def _rate(cls, v: int | None) -> int | None:
        if v is not None and v not in SAMPLE_RATES:
            raise ValueError(f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}")
        return v


# The synthesis bodies keep unknown top-level fields (model_extra): the server decides whether they are ignored
# and reported, or a 400 (--strict-request-fields).
_LENIENT = ConfigDict(extra="allow")


# The two combinations a speech body cannot mean (server/compat.speech_mode answers them with a 400), stated in
# the schema too, so a client generated from it never builds one.
_SPEECH_CONTRADICTIONS = {
    "not": {
        "anyOf": [
            {
                "properties": {"stream": {"const": False}, "stream_format": {"const": "sse"}},
                "required": ["stream", "stream_format"],
            },
            {
                "properties": {"timestamps": {"const": "segment"}, "stream_format": {"const": "audio"}},
                "required": ["timestamps", "stream_format"],
            },
        ]
    }
}


class SpeechRequest(ChatTTSOptions):
    """OpenAI `POST /v1/audio/speech` body (plus ChatTTS extras)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_SPEECH_CONTRADICTIONS)

    model: str = Field(..., min_length=1, max_length=256)
    input: str = Field(
        ...,
        min_length=1,
        description="text to speak (at most --max-input-chars, else 413; something speakable, else 400)",
        json_schema_extra=_SPEAKABLE,
    )
    voice: VoiceSpec = Field(
        ..., description='a voice name or id, or an object with exactly one of {"id": ...}, {"seed": n}, {"speaker": s}'
    )
    instructions: str | None = Field(None, max_length=4096)
    response_format: ResponseFormat = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    stream: bool | None = Field(
        None, description="Kokoro's switch: false = the whole file in one response (real status on a late failure)"
    )
    timestamps: Literal["segment"] | None = Field(
        None,
        description='"segment": the start and end (seconds) of each text segment, as speech.segment SSE events '
        "(stream_format sse) or, without a stream_format, in a JSON body with the audio in base64; "
        "no word-level timestamps",
    )


class SynthesizeRequest(ChatTTSOptions):
    """`POST /synthesize` body: the simple API. Returns the whole file unless `stream` is true."""

    model_config = _LENIENT

    text: str = Field(
        ...,
        min_length=1,
        description="text to speak (at most --max-input-chars, else 413)",
        json_schema_extra=_SPEAKABLE,
    )
    voice: VoiceSpec | None = Field(None, description="default: the built-in voice 'alloy'")
    format: ResponseFormat = "wav"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream: bool = False


class VoiceCreateJSON(_Strict):
    """`POST /v1/audio/voices` as JSON: a named voice from a speaker seed or a ChatTTS speaker string.
    (A reference recording is uploaded as multipart/form-data instead: name, audio_sample, transcript.)"""

    model_config = ConfigDict(
        json_schema_extra=_exactly_one_of({"seed": {"type": "integer"}, "speaker": {"type": "string"}})
    )

    name: str = Field(
        ...,
        min_length=1,
        max_length=64,
        pattern=VOICE_NAME_PATTERN,
        description="letters, digits, space, '_', '.', '-'; not a built-in voice name",
    )
    seed: _int(0, 2**32 - 1) | None = Field(None)
    speaker: str | None = Field(None, min_length=1, max_length=16384)

    @model_validator(mode="after")
    def _one_source(self) -> VoiceCreateJSON:
        if (self.seed is None) == (self.speaker is None):
            raise ValueError("give exactly one of seed, speaker")
        return self


class VoiceObject(BaseModel):
    id: str
    object: Literal["audio.voice"] = "audio.voice"
    name: str
    type: Literal["builtin", "seed", "speaker", "audio_sample"]
    created_at: int
    seed: int | None = None


class VoiceBrief(BaseModel):
    id: str
    name: str


class VoiceList(BaseModel):
    """OpenAI's list shape (`data`), and beside it `voices`, the shape Open WebUI and Kokoro clients read."""

    object: Literal["list"] = "list"
    data: list[VoiceObject]
    voices: list[VoiceBrief]


class VoiceDeleted(BaseModel):
    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool = True


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ttsserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


def refine_prompt_of(opts: ChatTTSOptions, instructions: str | None) -> str:
    """The refine prompt: `prompt` if given, else the control tokens found in `instructions`."""
    if opts.prompt is not None:
        return opts.prompt
    return "".join(REFINE_TOKEN_RE.findall(instructions or ""))


def build_synthesis_request(
    text: str,
    voice: Voice,
    opts: ChatTTSOptions,
    *,
    speed: float,
    instructions: str | None = None,
    max_new_tokens_cap: int | None = None,
    request_id: str | None = None,
) -> tuple[SynthesisRequest, float]:
    """HTTP options -> (SynthesisRequest, residual time-stretch factor for the decoded audio).

    Raises ValueError (message names the field) for values the engine's dataclasses reject.
    """
    speed_index, residual = speed_to_prompt(speed)
    overrides = {
        k: getattr(opts, k)
        for k in ("seed", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "min_new_tokens")
        if getattr(opts, k) is not None
    }
    cap = max_new_tokens_cap
    if cap is not None:
        overrides["max_new_tokens"] = min(overrides.get("max_new_tokens", cap), cap)
        if "min_new_tokens" in overrides:
            overrides["min_new_tokens"] = min(overrides["min_new_tokens"], overrides["max_new_tokens"])
    code_params = SamplingParams.code_defaults(**overrides)
    refine_prompt = refine_prompt_of(opts, instructions)
    refine_text = opts.refine_text if opts.refine_text is not None else bool(refine_prompt)
    refine_params = SamplingParams.refine_defaults(**({"seed": opts.seed} if opts.seed is not None else {}))
    req = SynthesisRequest(
        text=text,
        voice=voice,
        code_params=code_params,
        refine_text=refine_text,
        refine_params=refine_params,
        refine_prompt=refine_prompt,
        code_prompt=speed_token(speed_index),
        normalize=True if opts.normalize is None else opts.normalize,
        request_id=request_id,
    )
    return req, residual
