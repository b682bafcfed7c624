"""ChatTTS text tokenizer: BERT WordPiece through the `tokenizers` library (MODEL.md §2.1, §4.7).

The reference uses transformers' `BertTokenizerFast`; we load the same `tokenizer.json` with the raw
`tokenizers` library and undo the two differences that matter:
- the file carries fixed padding (256) and truncation (256); transformers switches both off for the
  reference's call, so we call `no_padding()` / `no_truncation()` (long prompts stay whole);
- transformers adds `clean_up_tokenization` on the whole decoded string; we apply the same replacements.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

# The specials the engine needs by name. A tokenizer without one of them is not a ChatTTS tokenizer.
REQUIRED_SPECIALS = (
    "[PAD]", "[UNK]", "[Stts]", "[Ptts]", "[Sbreak]", "[Pbreak]", "[Ebreak]",
    "[spk_emb]", "[empty_spk]", "[break_0]", "[uv_break]", "[laugh]", "[lbreak]", "[speed_5]",
)  # fmt: skip

# transformers' clean_up_tokenization: plain str.replace calls, in this order (MODEL.md §4.7 step 3.2).
_CLEANUP_REPLACEMENTS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
    (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


def clean_up_tokenization(text: str) -> str:
    """transformers' whole-string cleanup of decoded text (MODEL.md §4.7)."""
    for old, new in _CLEANUP_REPLACEMENTS:
        text = text.replace(old, new)
    return text


class TextTokenizer:
    """Encode prompt strings to text ids and decode refine-stage output (MODEL.md §2.1, §4.7).

    `encode` never adds [CLS]/[SEP], never pads and never truncates. Special tokens (`[uv_break]`,
    `[spk_emb]`, ...) are matched verbatim before the BERT normalizer lower-cases the rest.
    """

    def __init__(self, tokenizer: Tokenizer):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tok = tokenizer
        self._special_ids: dict[str, int] = {}
        for name in REQUIRED_SPECIALS:
            tid = tokenizer.token_to_id(name)
            if tid is None:
                raise ValueError(f"tokenizer is missing the required special token {name!r}")
            self._special_ids[name] = tid

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> TextTokenizer:
        """Load `asset/tokenizer/` (the folder holding tokenizer.json)."""
        file = os.path.join(os.fspath(path), "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"no tokenizer.json in {os.fspath(path)!r}")
        return cls(Tokenizer.from_file(file))

    @classmethod
    def from_file(cls, file: str | os.PathLike) -> TextTokenizer:
        return cls(Tokenizer.from_file(os.fspath(file)))

    def to_json(self) -> str:
        """The whole tokenizer as one JSON string (`tokenizer.json` content, padding and truncation off):
        what an API-server process needs to tokenize exactly as the engine does, without the checkpoint."""
        return self._tok.to_str()

    @classmethod
    def from_json(cls, text: str) -> TextTokenizer:
        """Inverse of `to_json`; ValueError for a string that is not a ChatTTS tokenizer."""
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"not a tokenizer JSON: {e}") from None
        return cls(tok)

    # ---- encoding -------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text ids of one prompt string, without [CLS]/[SEP], unpadded and untruncated."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokens(self, text: str) -> list[str]:
        """Token strings of `encode(text)` (for debugging and tests)."""
        return self._tok.encode(text, add_special_tokens=False).tokens

    # ---- decoding -------------------------------------------------------------------------------

    def decode(self, ids: list[int]) -> str:
        """Reference `batch_decode(skip_special_tokens=False)` of ids: raw decode + whole-string cleanup."""
        return clean_up_tokenization(self._tok.decode(list(ids), skip_special_tokens=False))

    def decode_refined(self, ids: list[int]) -> str:
        """Refine-stage output ids (EOS already removed) -> the code-stage input text (MODEL.md §4.7).

        Keeps only ids < [break_0] (drops [break_*], [laugh_*], [oral_*], [speed_*]), then decodes
        like the reference. The result is not normalized again.
        """
        limit = self.break_0_id
        return self.decode([i for i in ids if i < limit])

    # ---- vocabulary ------------------------------------------------------------------------------

    def token_id(self, name: str) -> int:
        """Id of a token by its exact string, e.g. "[uv_break]"; ValueError if absent."""
        tid = self._special_ids.get(name)
        if tid is None:
            tid = self._tok.token_to_id(name)
        if tid is None:
            raise ValueError(f"unknown token {name!r}")
        return tid

    def has_token(self, name: str) -> bool:
        return self._tok.token_to_id(name) is not None

    def id_to_token(self, tid: int) -> str | None:
        return self._tok.id_to_token(tid)

    @property
    def vocab_size(self) -> int:
        """`len(tokenizer)`, added tokens included (= num_text_tokens of the GPT)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def spk_emb_id(self) -> int:
        return self._special_ids["[spk_emb]"]

    @property
    def empty_spk_id(self) -> int:
        return self._special_ids["[empty_spk]"]

    @property
    def break_0_id(self) -> int:
        """First id dropped from refined text: [break_0] and everything above it (MODEL.md §4.7)."""
        return self._special_ids["[break_0]"]

    @property
    def ebreak_id(self) -> int:
        """EOS of the refine stage."""
        return self._special_ids["[Ebreak]"]

    @property
    def pad_id(self) -> int:
        return self._special_ids["[PAD]"]

    @property
    def unk_id(self) -> int:
        return self._special_ids["[UNK]"]
