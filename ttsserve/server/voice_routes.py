"""The voice routes: GET/POST /v1/audio/voices, GET/DELETE /v1/audio/voices/{voice_id} (an id or a name).

Each request sees the built-in voices, the public stored voices (made without API keys or with an admin key)
and the voices its own API key made (request.state.voice_scope, set by the app's identity check). Every store
call runs in a worker thread (off_loop): a PostgreSQL store's calls are network round trips.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ttsserve.audio.decode import AudioTooLongError, decode_audio_file
from ttsserve.constants import MAX_REFERENCE_SECONDS
from ttsserve.server.errors import ApiError, engine_param, parse_json_body
from ttsserve.server.protocol import VOICE_NAME_PATTERN, VoiceCreateJSON, VoiceDeleted, VoiceList, VoiceObject
from ttsserve.server.voices import (
    BUILTIN_VOICES,
    VoiceConflictError,
    VoiceRecord,
    VoiceScope,
    VoiceStoreError,
    builtin_records,
    check_voice_name,
)

logger = logging.getLogger("ttsserve.server")

# ---- HTTP routes -----------------------------------------------------------------------------------
MIN_REFERENCE_S = 0.5


async def off_loop(fn, *args):
    """fn(*args) in a worker thread, for calls that reach the voice store. A store that cannot be used (its
    database down) is a 503; the client is not told where the database is, the log is."""
    try:
        return await asyncio.to_thread(fn, *args)
    except VoiceStoreError as e:
        logger.warning("%s", e)
        raise ApiError(
            503, "the voices database is unavailable", code="voices_unavailable", headers={"Retry-After": "1"}
        ) from None


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
                                "pattern": r"\S",
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


def _reference_voice(st, name: str, data: bytes, transcript: str, owner: str | None) -> VoiceRecord:
    """Runs in a worker thread: decode (at most the cap), check, DVAE-encode, store.

    AudioTooLongError (a ValueError) for a recording over the cap, found from the header or while decoding.
    """
    check_voice_name(name)
    max_s = MAX_REFERENCE_SECONDS
    wav, rate = decode_audio_file(data, max_s)
    seconds = wav.size / rate
    if not (MIN_REFERENCE_S <= seconds <= max_s):
        raise ValueError(f"reference audio must last {MIN_REFERENCE_S:g}-{max_s:g} s, got {seconds:.2f} s")
    if not np.isfinite(wav).all():
        raise ValueError("reference audio contains NaN or infinite samples")
    codes = np.asarray(st.engine.encode_reference_audio(wav, rate))
    return st.store.create(name, "audio_sample", spk_smp=codes, txt_smp=transcript, owner=owner)


async def _create_from_upload(st, request, owner: str | None) -> VoiceRecord:
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
        return await off_loop(_reference_voice, st, name, data, transcript.strip(), owner)
    except VoiceConflictError as e:
        raise ApiError(409, str(e), param="name", code="voice_exists") from None
    except AudioTooLongError as e:
        raise ApiError(400, f"reference {e}", param="audio_sample", code="audio_too_long") from None
    except ValueError as e:  # the name's checks name it; the recording's do not
        raise ApiError(400, str(e), param=engine_param(e) or "audio_sample", code="invalid_value") from None


async def _create_from_json(st, request, owner: str | None) -> VoiceRecord:
    payload = parse_json_body(await request.body())
    try:
        body = VoiceCreateJSON.model_validate(payload)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
    try:
        if body.seed is not None:
            vec = st.voices.speaker_for_seed(body.seed)
            return await off_loop(_create, st.store, body.name, "seed", body.seed, vec, owner)
        try:
            vec = st.voices.parse_speaker(body.speaker)
        except ValueError as e:
            raise ApiError(400, f"speaker: {e}", param="speaker", code="invalid_value") from None
        return await off_loop(_create, st.store, body.name, "speaker", None, vec, owner)
    except VoiceConflictError as e:
        raise ApiError(409, str(e), param="name", code="voice_exists") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="name", code="invalid_value") from None


def _create(store, name: str, type_: str, seed: int | None, spk_emb, owner: str | None) -> VoiceRecord:
    return store.create(name, type_, seed=seed, spk_emb=spk_emb, owner=owner)


def _delete(store, voice_id: str, scope: VoiceScope) -> tuple[VoiceRecord | None, str]:
    """Delete a stored voice by id or name: (its record, "deleted"), (None, "missing") when `scope` sees
    none (or it went meanwhile), (record, "shared") for a visible voice `scope` does not own."""
    rec = store.get(voice_id, scope)  # by id, else by name
    if rec is not None and store.delete(rec.id, scope):
        return rec, "deleted"
    if rec is None or store.get(rec.id, scope) is None:
        return None, "missing"
    return rec, "shared"


def register_voice_routes(app, st, identity, errors: dict) -> None:
    """GET/POST /v1/audio/voices, GET/DELETE /v1/audio/voices/{voice_id}. `st`: the app's ServerState."""

    @app.get("/v1/audio/voices", response_model=VoiceList, responses=errors, tags=["voices"])
    async def list_voices(request: Request, _: str = Depends(identity)):
        voices = builtin_records() + await off_loop(st.store.list, request.state.voice_scope)
        return {
            "object": "list",
            "data": [r.public() for r in voices],
            "voices": [{"id": r.id, "name": r.name} for r in voices],
        }

    @app.post(
        "/v1/audio/voices",
        response_model=VoiceObject,
        responses={**errors, 409: errors[400]},
        openapi_extra=_voice_create_doc(MAX_REFERENCE_SECONDS),
        tags=["voices"],
    )
    async def create_voice(request: Request, ident: str = Depends(identity)):
        """A named voice from a speaker seed or a ChatTTS speaker string (JSON), or from a reference
        recording plus its transcript (multipart: name, audio_sample, transcript)."""
        st.rate.check(ident, 0)  # counts as a request (an upload runs the DVAE encoder)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        owner = request.state.voice_scope.owner
        if ctype == "multipart/form-data":
            rec = await _create_from_upload(st, request, owner)
        elif ctype in ("application/json", ""):
            rec = await _create_from_json(st, request, owner)
        else:
            raise ApiError(
                415,
                f"unsupported content type {ctype!r}: send JSON or multipart/form-data",
                code="unsupported_media_type",
            )
        return rec.public()

    @app.get("/v1/audio/voices/{voice_id}", response_model=VoiceObject, responses=errors, tags=["voices"])
    async def get_voice(voice_id: str, request: Request, _: str = Depends(identity)):
        rec = await off_loop(st.voices.lookup, voice_id, request.state.voice_scope)
        if rec is None:
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice_id", code="voice_not_found")
        return rec.public()

    @app.delete("/v1/audio/voices/{voice_id}", response_model=VoiceDeleted, responses=errors, tags=["voices"])
    async def delete_voice(voice_id: str, request: Request, _: str = Depends(identity)):
        """Delete a stored voice by its id or its name."""
        if voice_id.lower() in BUILTIN_VOICES:
            raise ApiError(
                400, f"{voice_id!r} is a built-in voice and cannot be deleted", param="voice_id", code="builtin_voice"
            )
        rec, outcome = await off_loop(_delete, st.store, voice_id, request.state.voice_scope)
        if outcome == "missing":
            raise ApiError(404, f"voice {voice_id!r} not found", param="voice_id", code="voice_not_found")
        if outcome == "shared":  # visible but not this key's: a public voice
            raise ApiError(
                403,
                f"voice {voice_id!r} is shared: only an admin key deletes it",
                param="voice_id",
                code="forbidden",
            )
        return {"id": rec.id, "object": "audio.voice.deleted", "deleted": True}
