"""How many input characters one token can cover at most: a bound on the work before tokenizing.

    tokenizer.json (normalizer, pre_tokenizer, model, added_tokens) --max_chars_per_token--> L | None

A text of C characters needs at least C / L tokens, so a prompt longer than max_model_len x L characters
cannot fit the model and is refused before it is tokenized. L is the longest vocabulary entry or added
token, times the most input characters a normalizer can fold into one (4 for NFC / NFKC composition:
the longest canonical decomposition). No bound (None) when some stage can drop or merge input freely:
normalizers that strip or rewrite by regex, pre-tokenizers that drop whitespace, or models that map a
whole unknown word or run of unknown characters to one token (WordPiece, WordLevel over words, a
Unigram or BPE that fuses unknowns without byte fallback). Byte-level BPE and SentencePiece-style
(Metaspace, byte fallback) tokenizers, as Llama, Mistral and Qwen use, keep every character.
"""

from __future__ import annotations

from typing import Any

_COMPOSING = {"NFC": 4, "NFKC": 4}  # input characters that can compose into one
_EXPANDING = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}  # never fewer characters out than in
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
_SINGLE_CHAR_PATTERNS = {".", "(?s:.)", r"[\s\S]", r"[\S\s]"}


def _normalizer_factor(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            part_factor = _normalizer_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind in _EXPANDING:
        return 1
    if kind == "Replace":  # a literal replaced by one at least as long never shortens the text
        pattern = normalizer.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        return 1 if literal and len(normalizer.get("content", "")) >= len(literal) else None
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, regex Replace, ...


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _splits_single_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    """A pre-tokenizer that isolates every character (a WordLevel "word" is then one character)."""
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_splits_single_characters(part) for part in pre_tokenizer.get("pretokenizers", []))
    pattern = pre_tokenizer.get("pattern", {})
    return (pre_tokenizer.get("type") == "Split" and pre_tokenizer.get("behavior") == "Isolated"
            and isinstance(pattern, dict) and pattern.get("Regex") in _SINGLE_CHAR_PATTERNS)


def _model_chars(model: dict[str, Any], pre_tokenizer: dict[str, Any] | None, byte_level: bool) -> int | None:
    kind = model.get("type")
    vocab = model.get("vocab") or {}
    pieces = [entry[0] for entry in vocab] if isinstance(vocab, list) else list(vocab)
    longest = max((len(piece) for piece in pieces), default=1)
    if kind == "BPE":
        # Without byte fallback an unknown character becomes <unk> (fused runs: one for many) or nothing.
        known = byte_level or model.get("byte_fallback") or (model.get("unk_token") is not None
                                                              and not model.get("fuse_unk"))
        return longest if known else None
    if kind == "Unigram":
        return longest if model.get("byte_fallback") else None
    if kind == "WordLevel":
        return 1 if _splits_single_characters(pre_tokenizer) else None
    return None  # WordPiece: a long word is one [UNK]


def _mentions_byte_level(part: dict[str, Any] | None) -> bool:
    if part is None:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_mentions_byte_level(p) for key in ("normalizers", "pretokenizers") for p in part.get(key, []))


def max_chars_per_token(spec: dict[str, Any]) -> int | None:
    """The most input characters one token covers, from a parsed tokenizer.json; None when unbounded."""
    factor = _normalizer_factor(spec.get("normalizer"))
    pre_tokenizer = spec.get("pre_tokenizer")
    if factor is None or not _keeps_characters(pre_tokenizer):
        return None
    byte_level = _mentions_byte_level(spec.get("normalizer")) or _mentions_byte_level(pre_tokenizer)
    model_chars = _model_chars(spec.get("model") or {}, pre_tokenizer, byte_level)
    if model_chars is None:
        return None
    added = max((len(token.get("content", "")) for token in spec.get("added_tokens") or []), default=1)
    return factor * max(model_chars, added, 1)
