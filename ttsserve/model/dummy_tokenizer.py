"""A BERT-Chinese-shaped WordPiece tokenizer for dummy checkpoints (the real vocabulary cannot be downloaded here).

Same structure as the published `asset/tokenizer/`: ids 0..103 like bert-base-chinese, then ASCII, `##` pieces,
common English words and CJK characters up to `num_wordpiece`, then the 50 ChatTTS specials as added tokens; the
fixed padding/truncation block at 256 that the real file carries (MODEL.md §2.1) is kept on purpose so the loader's
handling of that pitfall is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part "
    "hello world test speech model today weather good very nice thank thanks please yes okay fine price dollars "
    "favorite english food what where why because morning evening night friend music audio voice text server"
).split()


def _vocab(num_wordpiece: int) -> list[str]:
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab += [chr(c) for c in range(0xFF01, 0xFF5F)] + list("“”‘’、。《》「」【】—…·")
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab += _WORDS
    vocab = list(dict.fromkeys(vocab))  # ordered de-duplication
    seen = set(vocab)
    cjk = (chr(c) for c in range(0x4E00, 0xA000))
    for ch in cjk:
        if len(vocab) >= num_wordpiece:
            break
        if ch not in seen:
            vocab.append(ch)
    i = 0
    while len(vocab) < num_wordpiece:  # only for vocabularies larger than the CJK block
        vocab.append(f"[unused_fill{i}]")
        i += 1
    return vocab[:num_wordpiece]


def _added(token_id: int, content: str) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def write_tokenizer(out_dir: Path, num_wordpiece: int, specials: list[str]) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(num_wordpiece)
    base_special = {0: "[PAD]", 100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
    added = [_added(i, t) for i, t in base_special.items()]
    added += [_added(num_wordpiece + i, t) for i, t in enumerate(specials)]
    tok = {
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 256, "strategy": "LongestFirst", "stride": 0},
        "padding": {
            "strategy": {"Fixed": 256},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "[PAD]",
        },
        "added_tokens": added,
        "normalizer": {
            "type": "BertNormalizer",
            "clean_text": True,
            "handle_chinese_chars": True,
            "strip_accents": None,
            "lowercase": True,
        },
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {
            "type": "WordPiece",
            "unk_token": "[UNK]",
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {t: i for i, t in enumerate(vocab)},
        },
    }
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=2))
    decoder = {
        str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for a in added
    }
    cfg = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(specials),
        "clean_up_tokenization_spaces": True,
        "cls_token": "[CLS]",
        "do_basic_tokenize": True,
        "do_lower_case": True,
        "mask_token": "[MASK]",
        "model_max_length": 1000000000000000019884624838656,
        "never_split": None,
        "pad_token": "[PAD]",
        "padding_side": "right",
        "sep_token": "[SEP]",
        "strip_accents": None,
        "tokenize_chinese_chars": True,
        "tokenizer_class": "BertTokenizer",
        "unk_token": "[UNK]",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=2))
    special_map = {
        "additional_special_tokens": [
            {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
            for t in specials
        ],
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, ensure_ascii=False, indent=2))
