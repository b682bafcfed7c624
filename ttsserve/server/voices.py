"""Named voices: fixed built-in speakers for OpenAI's voice names, and user voices persisted in SQLite.

A stored voice keeps the speaker vector itself (fp16 [hidden]) or the audio-code prompt (int32 [num_vq, P])
plus its transcript, never just the recipe, so it sounds the same after a restart even if the engine's
random-speaker sampler changed. Built-in voices are a fixed seed each, drawn with engine.random_speaker
(deterministic), so the same name always gives the same speaker.
"""

from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ttsserve.audio.decode import AudioTooLongError, decode_audio_file
from ttsserve.engine.errors import InvalidRequestError
from ttsserve.params import Voice
from ttsserve.server.errors import ApiError, engine_param, parse_json_body
from ttsserve.server.protocol import (
    VOICE_NAME_PATTERN,
    VoiceCreateJSON,
    VoiceDeleted,
    VoiceList,
    VoiceObject,
)

# OpenAI's voice names (the SDK's list) -> fixed speaker seeds.
BUILTIN_VOICES: dict[str, int] = {
    "alloy": 1384,
    "ash": 4099,
    "ballad": 5099,
    "coral": 6653,
    "echo": 2443,
    "fable": 7869,
    "onyx": 9041,
    "nova": 1089,
    "sage": 2222,
    "shimmer": 3331,
    "verse": 4447,
    "marin": 5557,
    "cedar": 6661,
}
DEFAULT_VOICE = "alloy"
NAME_RE = re.compile(VOICE_NAME_PATTERN)
BUILTIN_CREATED_AT = 1_700_000_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,          -- seed | speaker | audio_sample
    created_at INTEGER NOT NULL,
    seed INTEGER,
    spk_emb BLOB,                -- fp16 little-endian [hidden]
    spk_smp BLOB,                -- int32 little-endian [num_vq, P], row-major
    spk_smp_rows INTEGER,
    txt_smp TEXT
)
"""


@dataclass(frozen=True)
class VoiceRecord:
    id: str
    name: str
    type: str  # "builtin" | "seed" | "speaker" | "audio_sample"
    created_at: int
    seed: int | None = None
    spk_emb: np.ndarray | None = None  # float16 [hidden]
    spk_smp: np.ndarray | None = None  # int32 [num_vq, P]
    txt_smp: str | None = None

    def public(self) -> dict:
        """The API's voice object (no vectors)."""
        return {
            "id": self.id,
            "object": "audio.voice",
            "name": self.name,
            "type": self.type,
            "created_at": self.created_at,
            "seed": self.seed,
        }


class VoiceConflictError(ValueError):
    """A voice with that name exists already."""


class VoiceStore:
    """SQLite-backed voice table. Thread-safe (one connection behind a lock; every call is short).

    path: a file path, or ":memory:" for a store that does not persist.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(
        self,
        name: str,
        type: str,
        *,
        seed: int | None = None,
        spk_emb: np.ndarray | None = None,
        spk_smp: np.ndarray | None = None,
        txt_smp: str | None = None,
    ) -> VoiceRecord:
        """Insert a voice. ValueError for a bad/built-in name, VoiceConflictError for a taken name."""
        check_voice_name(name)
        emb = None if spk_emb is None else np.ascontiguousarray(spk_emb, dtype="<f2").reshape(-1)
        smp = None if spk_smp is None else np.ascontiguousarray(spk_smp, dtype="<i4")
        if smp is not None and smp.ndim != 2:
            raise ValueError(f"spk_smp must be [num_vq, P], got shape {smp.shape}")
        rec = VoiceRecord(f"voice_{uuid.uuid4().hex[:24]}", name, type, int(time.time()), seed, emb, smp, txt_smp)
        row = (
            rec.id,
            name,
            type,
            rec.created_at,
            seed,
            None if emb is None else emb.tobytes(),
            None if smp is None else smp.tobytes(),
            None if smp is None else smp.shape[0],
            txt_smp,
        )
        with self._lock:
            try:
                self._db.execute("INSERT INTO voices VALUES (?,?,?,?,?,?,?,?,?)", row)
            except sqlite3.IntegrityError:
                raise VoiceConflictError(f"a voice named {name!r} exists already") from None
        return rec

    def get(self, key: str) -> VoiceRecord | None:
        """A stored voice by id, else by name; None if neither matches."""
        with self._lock:
            row = self._db.execute("SELECT * FROM voices WHERE id = ?", (key,)).fetchone()
            row = row or self._db.execute("SELECT * FROM voices WHERE name = ?", (key,)).fetchone()
        return None if row is None else _record(row)

    def list(self) -> list[VoiceRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM voices ORDER BY rowid").fetchall()
        return [_record(r) for r in rows]

    def delete(self, voice_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM voices WHERE id = ?", (voice_id,))
        return cur.rowcount > 0


def check_voice_name(name: str) -> str:
    """`name` unchanged; InvalidRequestError (param "name") for a malformed or built-in name."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidRequestError("voice name must be 1-64 characters of letters, digits, space, '_', '.', '-'", "name")
    if name.lower() in BUILTIN_VOICES:
        raise InvalidRequestError(f"{name!r} is a built-in voice name", "name")
    return name


def _record(row: tuple) -> VoiceRecord:
    vid, name, type_, created_at, seed, emb, smp, rows, txt = row
    spk_emb = None if emb is None else np.frombuffer(emb, dtype="<f2").copy()
    spk_smp = None if smp is None else np.frombuffer(smp, dtype="<i4").reshape(rows, -1).copy()
    return VoiceRecord(vid, name, type_, created_at, seed, spk_emb, spk_smp, txt)


def builtin_records() -> list[VoiceRecord]:
    return [VoiceRecord(n, n, "builtin", BUILTIN_CREATED_AT, s) for n, s in BUILTIN_VOICES.items()]


class VoiceResolver:
    """Voice specs of requests -> engine Voices.

    random_speaker: engine.random_speaker (seed -> fp16 [hidden]); results are cached per seed.
    parse_speaker: engine.parse_speaker (ChatTTS speaker string -> fp16 [hidden], ValueError if bad).
    """

    def __init__(
        self,
        store: VoiceStore,
        random_speaker: Callable[[int], np.ndarray],
        parse_speaker: Callable[[str], np.ndarray],
    ) -> None:
        self.store = store
        self._random_speaker = random_speaker
        self._parse_speaker = parse_speaker
        self._seed_cache: dict[int, np.ndarray] = {}

    def speaker_for_seed(self, seed: int) -> np.ndarray:
        vec = self._seed_cache.get(seed)
        if vec is None:
            if len(self._seed_cache) > 4096:  # bounded: request-supplied seeds are unbounded
                self._seed_cache.clear()
            vec = self._seed_cache[seed] = np.asarray(self._random_speaker(seed))
        return vec

    def parse_speaker(self, s: str) -> np.ndarray:
        return np.asarray(self._parse_speaker(s))

    def lookup(self, key: str) -> VoiceRecord | None:
        """A built-in name (case-insensitive), a stored voice id, or a stored voice name."""
        seed = BUILTIN_VOICES.get(key.lower())
        if seed is not None:
            return VoiceRecord(key.lower(), key.lower(), "builtin", BUILTIN_CREATED_AT, seed)
        return self.store.get(key)

    def to_voice(self, rec: VoiceRecord) -> Voice:
        if rec.type == "builtin" or (rec.spk_emb is None and rec.spk_smp is None and rec.seed is not None):
            return Voice(spk_emb=self.speaker_for_seed(rec.seed), name=rec.name)
        return Voice(spk_emb=rec.spk_emb, spk_smp=rec.spk_smp, txt_smp=rec.txt_smp, name=rec.name)

    def resolve(self, spec) -> Voice | None:
        """spec: None (default voice), a name/id string, or a VoiceRef. None if the name/id is unknown.

        Raises ValueError for a bad speaker string.
        """
        if spec is None:
            spec = DEFAULT_VOICE
        if isinstance(spec, str):
            rec = self.lookup(spec)
            return None if rec is None else self.to_voice(rec)
        if spec.id is not None:
            return self.resolve(spec.id)
        if spec.seed is not None:
            return Voice(spk_emb=self.speaker_for_seed(spec.seed), name=f"seed:{spec.seed}")
        return Voice(spk_emb=self.parse_speaker(spec.speaker), name="speaker")


# ---- HTTP routes -----------------------------------------------------------------------------------
MIN_REFERENCE_S = 0.5


def max_reference_seconds() -> float:
    """The longest reference recording accepted: the engine's own cap (engine.voice_encode), one number.

    Why 30 s: the DVAE codes of the recording become prompt positions (46.875 per second, MODEL.md §5.4 / §2.6)
    in front of the transcript and the text, and prompt plus output must fit the model's 4096 positions
    (MODEL.md §0, "Max positions"). 30 s is 1406 positions and leaves room for a full 2048-frame (44 s) segment
    plus about 640 text tokens; 60 s (2813 positions) would cut every segment to under 1283 frames even
    with no text at all. Imported here, not at module top, so that importing the server (launchers,
    config checks) does not import torch.
    """
    from ttsserve.engine.voice_encode import MAX_REFERENCE_SECONDS

    return MAX_REFERENCE_SECONDS


def _voice_create_doc(max_s: float) -> dict:
    audio = {
        "type": "string",
        "format": "binary",
        "description": f"reference recording (wav, flac, ogg, mp3, ...), {MIN_REFERENCE_S:g}-{max_s:g} s",
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/VoiceCreateJSON"}},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["name", "audio_sample", "transcript"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1, "maxLength": 64, "pattern": VOICE_NAME_PATTERN},
                            "audio_sample": audio,
                            "transcript": {
                                "type": "string",
                                "minLength": 1,
                                "maxLength": 2000,
                                "description": "what is said in the recording",
                            },
                            "consent": {
                                "type": "string",
                                "description": "accepted for OpenAI SDK compatibility; unused",
                            },
                        },
                    }
                },
            },
        }
    }


def _reference_voice(st, name: str, data: bytes, transcript: str) -> VoiceRecord:
    """Runs in a worker thread: decode (at most the cap), check, DVAE-encode, store.

    AudioTooLongError (a ValueError) for a recording over the cap, found from the header or while decoding.
    """
    check_voice_name(name)
    max_s = max_reference_seconds()
    wav, rate = decode_audio_file(data, max_s)
    seconds = wav.size / rate
    if not (MIN_REFERENCE_S <= seconds <= max_s):
        raise ValueError(f"reference audio must last {MIN_REFERENCE_S:g}-{max_s:g} s, got {seconds:.2f} s")
    if not np.isfinite(wav).all():
        raise ValueError("reference audio contains NaN or infinite samples")
    codes = np.asarray(st.engine.encode_reference_audio(wav, rate))
    return st.store.create(name, "audio_sample", spk_smp=codes, txt_smp=transcript)


async def _create_from_upload(st, request) -> VoiceRecord:
    form = await request.form(max_files=1, max_fields=8)
    name, audio, transcript = form.get("name"), form.get("audio_sample") or form.get("file"), form.get("transcript")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "name is required", param="name", code="missing_required_parameter")
    if audio is None or isinstance(audio, str):
        raise ApiError(
            400, "audio_sample (a file) is required", param="audio_sample", code="missing_required_parameter"
        )
    if not isinstance(transcript, str) or not transcript.strip() or len(transcript) > 2000:
        raise ApiError(
            400,
            "transcript (1-2000 characters: what the recording says) is required",
            param="transcript",
            code="missing_required_parameter",
        )
    data = await audio.read()
    try:
        return await asyncio.to_thread(_reference_voice, st, name, data, transcript.strip())
    except VoiceConflictError as e:
        raise ApiError(409, str(e), param="name", code="voice_exists") from None
    except AudioTooLongError as e:
        raise ApiError(400, f"reference {e}", param="audio_sample", code="audio_too_long") from None
    except ValueError as e:  # the name's checks name it; the recording's do not
        raise ApiError(400, str(e), param=engine_param(e) or "audio_sample") from None


async def _create_from_json(st, request) -> VoiceRecord:
    payload = parse_json_body(await request.body())
    try:
        body = VoiceCreateJSON.model_validate(payload)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    try:
        if body.seed is not None:
            vec = st.voices.speaker_for_seed(body.seed)
            return st.store.create(body.name, "seed", seed=body.seed, spk_emb=vec)
        try:
            vec = st.voices.parse_speaker(body.speaker)
        except ValueError as e:
            raise ApiError(400, f"speaker: {e}", param="speaker") from None
        return st.store.create(body.name, "speaker", spk_emb=vec)
    except VoiceConflictError as e:
        raise ApiError(409, str(e), param="name", code="voice_exists") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="name") from None


def register_voice_routes(app, st, identity, errors: dict) -> None:
    """GET/POST /v1/audio/voices, GET/DELETE /v1/audio/voices/{voice_id}. `st`: the app's ServerState."""

    @app.get("/v1/audio/voices", response_model=VoiceList, responses=errors, tags=["voices"])
    async def list_voices(_: str = Depends(identity)):
        return {"object": "list", "data": [r.public() for r in builtin_records() + st.store.list()]}

    @app.post(
        "/v1/audio/voices",
        response_model=VoiceObject,
        responses={**errors, 409: errors[400]},
        openapi_extra=_voice_create_doc(max_reference_seconds()),
        tags=["voices"],
    )
    async def create_voice(request: Request, ident: str = Depends(identity)):
        """A named voice from a speaker seed or a ChatTTS speaker string (JSON), or from a reference
        recording plus its transcript (multipart: name, audio_sample, transcript)."""
        st.rate.check(ident, 0)  # counts as a request (an upload runs the DVAE encoder)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "multipart/form-data":
            rec = await _create_from_upload(st, request)
        elif ctype in ("application/json", ""):
            rec = await _create_from_json(st, request)
        else:
            raise ApiError(
                415,
                f"unsupported content type {ctype!r}: send JSON or multipart/form-data",
                code="unsupported_media_type",
            )
        return rec.public()

    @app.get("/v1/audio/voices/{voice_id}", response_model=VoiceObject, responses=errors, tags=["voices"])
    async def get_voice(voice_id: str, _: str = Depends(identity)):
        rec = st.voices.lookup(voice_id)
        if rec is None:
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice_id", code="voice_not_found")
        return rec.public()

    @app.delete("/v1/audio/voices/{voice_id}", response_model=VoiceDeleted, responses=errors, tags=["voices"])
    async def delete_voice(voice_id: str, _: str = Depends(identity)):
        if voice_id.lower() in BUILTIN_VOICES:
            raise ApiError(400, f"{voice_id!r} is a built-in voice and cannot be deleted", param="voice_id")
        if not st.store.delete(voice_id):
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice_id", code="voice_not_found")
        return {"id": voice_id, "object": "audio.voice.deleted", "deleted": True}
