"""Named voices: fixed built-in speakers for OpenAI's voice names, and user voices persisted in a VoiceStore
(SQLite, or PostgreSQL shared by several servers).

A stored voice keeps the speaker vector itself (fp16 [hidden]) or the audio-code prompt (int32 [num_vq, P])
plus its transcript, never just the recipe, so it sounds the same after a restart even if the engine's
random-speaker sampler changed. Built-in voices are a fixed seed each, drawn with engine.random_speaker
(deterministic), so the same name always gives the same speaker.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ttsserve.engine.errors import InvalidRequestError
from ttsserve.params import Voice
from ttsserve.server.protocol import (
    VOICE_NAME_PATTERN,
)
from ttsserve.server.voice_mix import VoiceMixError, is_mix, mix_speakers, parse_voice_mix

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

_COLUMNS = "id, name, type, created_at, seed, spk_emb, spk_smp, spk_smp_rows, txt_smp, owner"
# A row is visible to a scope that sees all, and to everyone when public (owner NULL) or theirs.
_VISIBLE = "(? OR owner IS NULL OR owner = ?)"


@dataclass(frozen=True)
class VoiceScope:
    """Whose voices a request sees. owner: the id of the API key that creates voices (None: they are public,
    as with no --api-key or an admin key); see_all: every stored voice is visible (admin, or no keys)."""

    owner: str | None = None
    see_all: bool = True

    def sql_args(self) -> tuple:
        return (self.see_all, self.owner)


PUBLIC = VoiceScope()


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
    owner: str | None = None

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


class UnknownVoiceError(LookupError):
    """A voice named in a mix does not exist (or is another API key's)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class VoiceConflictError(ValueError):
    """A voice with that name exists already."""


class VoiceStoreError(RuntimeError):
    """The voice store cannot be used (its database is unreachable, or refused the login or the statement).

    store: the store's --voices-db value, its password masked; reason: one line, no password."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"voices database {store}: {reason}")
        self.store = store
        self.reason = reason


class VoiceStore:
    """The table of user voices: one interface, two backends, picked by voice_store.open_voice_store from
    --voices-db: SQLite (voice_store_sqlite.py: a file, or ":memory:") and PostgreSQL (voice_store_pg.py: one
    table shared by servers on several machines). The SQL is written once, here, with `?` placeholders.

    Thread-safe, and every call blocks (a PostgreSQL call is a network round trip): the server makes them from
    worker threads. A backend supplies `_fetch` (rows of a SELECT), `_execute` (rows changed) and `_insert`
    (False when the name is taken: the table's UNIQUE constraint decides, so of several creates of one name
    at once, on any servers sharing the table, exactly one wins), `close`, and `order_by`: the column that
    lists voices in creation order.
    """

    order_by = "rowid"

    def create(
        self,
        name: str,
        type: str,
        *,
        seed: int | None = None,
        spk_emb: np.ndarray | None = None,
        spk_smp: np.ndarray | None = None,
        txt_smp: str | None = None,
        owner: str | None = None,
    ) -> VoiceRecord:
        """Insert a voice owned by `owner` (None: public). ValueError for a bad/built-in name,
        VoiceConflictError for a taken name."""
        check_voice_name(name)
        emb = None if spk_emb is None else np.ascontiguousarray(spk_emb, dtype="<f2").reshape(-1)
        smp = None if spk_smp is None else np.ascontiguousarray(spk_smp, dtype="<i4")
        if smp is not None and smp.ndim != 2:
            raise ValueError(f"spk_smp must be [num_vq, P], got shape {smp.shape}")
        rec = VoiceRecord(
            f"voice_{uuid.uuid4().hex[:24]}", name, type, int(time.time()), seed, emb, smp, txt_smp, owner
        )
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
            owner,
        )
        if not self._insert(f"INSERT INTO voices ({_COLUMNS}) VALUES ({', '.join('?' * len(row))})", row):
            raise VoiceConflictError(f"a voice named {name!r} exists already")
        return rec

    def get(self, key: str, scope: VoiceScope = PUBLIC) -> VoiceRecord | None:
        """A stored voice `scope` may see, by id, else by name; None if neither matches (another key's voice
        is missing, to that key)."""
        for column in ("id", "name"):
            rows = self._fetch(
                f"SELECT {_COLUMNS} FROM voices WHERE {column} = ? AND {_VISIBLE}", (key, *scope.sql_args())
            )
            if rows:
                return _record(rows[0])
        return None

    def list(self, scope: VoiceScope = PUBLIC) -> list[VoiceRecord]:
        rows = self._fetch(f"SELECT {_COLUMNS} FROM voices WHERE {_VISIBLE} ORDER BY {self.order_by}", scope.sql_args())
        return [_record(r) for r in rows]

    def delete(self, voice_id: str, scope: VoiceScope = PUBLIC) -> bool:
        """Delete a voice `scope` owns (a scope that sees all owns all); False if there is none."""
        return self._execute("DELETE FROM voices WHERE id = ? AND (? OR owner = ?)", (voice_id, *scope.sql_args())) > 0

    def close(self) -> None:
        raise NotImplementedError

    def _fetch(self, sql: str, args: tuple) -> list[tuple]:
        raise NotImplementedError

    def _execute(self, sql: str, args: tuple) -> int:
        raise NotImplementedError

    def _insert(self, sql: str, row: tuple) -> bool:
        raise NotImplementedError


def check_voice_name(name: str) -> str:
    """`name` unchanged; InvalidRequestError (param "name") for a malformed or built-in name."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidRequestError("voice name must be 1-64 characters of letters, digits, space, '_', '.', '-'", "name")
    if name.lower() in BUILTIN_VOICES:
        raise InvalidRequestError(f"{name!r} is a built-in voice name", "name")
    return name


def _record(row: tuple) -> VoiceRecord:
    vid, name, type_, created_at, seed, emb, smp, rows, txt, owner = row
    spk_emb = None if emb is None else np.frombuffer(emb, dtype="<f2").copy()
    spk_smp = None if smp is None else np.frombuffer(smp, dtype="<i4").reshape(rows, -1).copy()
    return VoiceRecord(vid, name, type_, created_at, seed, spk_emb, spk_smp, txt, owner)


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

    def lookup(self, key: str, scope: VoiceScope = PUBLIC) -> VoiceRecord | None:
        """A built-in name (case-insensitive), or a stored voice id or name that `scope` may see."""
        seed = BUILTIN_VOICES.get(key.lower())
        if seed is not None:
            return VoiceRecord(key.lower(), key.lower(), "builtin", BUILTIN_CREATED_AT, seed)
        return self.store.get(key, scope)

    @staticmethod
    def needs_store(spec) -> bool:
        """Whether resolving `spec` may read the store (a blocking call, made off the event loop); the
        default voice, built-in names, seeds and speaker strings never do."""
        if spec is None:
            return False
        key = spec if isinstance(spec, str) else spec.id
        return key is not None and (is_mix(key) or key.lower() not in BUILTIN_VOICES)

    def to_voice(self, rec: VoiceRecord) -> Voice:
        if rec.type == "builtin" or (rec.spk_emb is None and rec.spk_smp is None and rec.seed is not None):
            return Voice(spk_emb=self.speaker_for_seed(rec.seed), name=rec.name)
        return Voice(spk_emb=rec.spk_emb, spk_smp=rec.spk_smp, txt_smp=rec.txt_smp, name=rec.name)

    def resolve(self, spec, scope: VoiceScope = PUBLIC) -> Voice | None:
        """spec: None (default voice), a name/id string, or a VoiceRef. None if the name/id is unknown (or
        another API key's).

        Raises ValueError for a bad speaker string or mix, UnknownVoiceError for an unknown voice in a mix.
        """
        if spec is None:
            spec = DEFAULT_VOICE
        if isinstance(spec, str) and is_mix(spec):
            return self.resolve_mix(spec, scope)
        if isinstance(spec, str):
            rec = self.lookup(spec, scope)
            return None if rec is None else self.to_voice(rec)
        if spec.id is not None:
            return self.resolve(spec.id, scope)
        if spec.seed is not None:
            return Voice(spk_emb=self.speaker_for_seed(spec.seed), name=f"seed:{spec.seed}")
        return Voice(spk_emb=self.parse_speaker(spec.speaker), name="speaker")

    def resolve_mix(self, spec: str, scope: VoiceScope = PUBLIC) -> Voice:
        """ "a(0.7)+b(0.3)" -> one Voice whose speaker vector mixes theirs (voice_mix.mix_speakers).

        VoiceMixError for bad syntax, a bad weight, or a recording-based voice (its audio prompt is a sequence
        of codes with a transcript, which has no meaningful average); UnknownVoiceError for an unknown name.
        """
        terms = parse_voice_mix(spec)
        vectors = []
        for name, _ in terms:
            rec = self.lookup(name, scope)
            if rec is None:
                raise UnknownVoiceError(name)
            voice = self.to_voice(rec)
            if voice.spk_smp is not None or voice.spk_emb is None:
                raise VoiceMixError(f"voice {name!r} is a reference recording (audio prompt) and cannot be mixed")
            vectors.append(voice.spk_emb)
        label = "+".join(f"{name}({w:.3g})" for name, w in terms)
        return Voice(spk_emb=mix_speakers(vectors, [w for _, w in terms]), name=label)
