"""Tokenizers: byte-level for kdt's random fixtures, the checkpoint's own tokenizer.json otherwise.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``stream()``, an incremental
decoder that turns token ids into text as they are committed (holding back incomplete UTF-8).
"""

from __future__ import annotations

import codecs

from kdt.errors import KdtError


class ByteTokenizer:
    """Token id = byte value (0..255). Ids >= 256 (a random fixture's vocabulary is larger) have no
    text and decode to U+FFFD."""

    kind = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return self.stream().feed(ids)

    def stream(self) -> _ByteStream:
        return _ByteStream()


class _ByteStream:
    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids) -> str:
        out = []
        for t in ids:
            t = int(t)
            out.append(self._dec.decode(bytes([t])) if t < 256 else "\ufffd")
        return "".join(out)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

    kind = "tokenizers"

    def __init__(self, json_text: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise KdtError("this model carries a tokenizer.json: install the 'tokenizers' package "
                           "(pip install 'kdt[convert]')") from None
        self._tok = Tokenizer.from_str(json_text)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stream(self) -> _HFStream:
        return _HFStream(self)


class _HFStream:
    """Decode the whole sequence so far and emit the new suffix (handles merges across tokens)."""

    def __init__(self, tok: HFTokenizer):
        self.tok, self.ids, self.text = tok, [], ""

    def feed(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for more
            return ""
        new, self.text = text[len(self.text):], text
        return new


def load_tokenizer(spec: dict | None):
    """From a fixture's tokenizer entry (``{"kind": "byte"}`` or ``{"kind": "tokenizers", "json": ...}``)."""
    if spec and spec.get("kind") == "tokenizers" and spec.get("json"):
        return HFTokenizer(spec["json"])
    return ByteTokenizer()
