"""Tokenizers: byte-level (default, nothing to train) and BPE (optional `tokenizers` package).

Both map bytes to a 1-D integer array and back. The BPE tokenizer is trained offline on the
training split and saved as `tokenizer.json` in the run directory, so a resumed run, `eval`
and `generate` use exactly the same vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

BPE_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    """What the training loop needs of a tokenizer: its vocabulary size (the model's
    embedding rows), a name recorded with the run, and byte <-> id conversions."""

    vocab_size: int
    name: str

    def encode(self, data: bytes) -> np.ndarray:
        """bytes -> [n] token ids."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text."""
        ...


class ByteTokenizer:
    """Token i is byte i: vocabulary 256, lossless for any input, bits per byte = bits per token."""

    vocab_size = 256
    name = "byte"

    def encode(self, data: bytes) -> np.ndarray:
        """bytes -> [n] uint8 (one token per byte)."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; invalid UTF-8 sequences become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE from the `tokenizers` package; token 0 is the end-of-text marker."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, documents: Iterable[bytes], vocab_size: int) -> "BPETokenizer":
        """Trains a byte-level BPE with `vocab_size` entries on `documents`."""
        tokenizers = _import_tokenizers()
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[END_OF_TEXT],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator((d.decode("utf-8", errors="replace") for d in documents), trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "BPETokenizer":
        """Loads a `tokenizer.json` (any `tokenizers` tokenizer); errors name the file."""
        tokenizers = _import_tokenizers()
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001  (the library's errors do not name the file)
            raise ValueError(f"{path}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer to ``path`` (the tokenizers library's JSON)."""
        self._tok.save(str(path))

    def encode(self, data: bytes) -> np.ndarray:
        """bytes (UTF-8 text) -> [n] uint32 token ids."""
        return np.asarray(self._tok.encode(data.decode("utf-8", errors="replace")).ids, dtype=np.uint32)

    def encode_documents(self, documents: list[bytes]) -> list[np.ndarray]:
        """Encodes many documents in parallel, each followed by the end-of-text token."""
        eot = self._tok.token_to_id(END_OF_TEXT)
        texts = [d.decode("utf-8", errors="replace") for d in documents]
        suffix = [] if eot is None else [eot]
        return [np.asarray(e.ids + suffix, dtype=np.uint32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text."""
        return self._tok.decode([int(i) for i in ids])


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "data.tokenizer=bpe needs the optional `tokenizers` package: pip install 'jax-twell[bpe]'"
        ) from None
    return tokenizers


def load_tokenizer(spec: str, workdir: str | Path) -> Tokenizer | None:
    """The tokenizer named by `spec` ("byte", "bpe", or a tokenizer.json path).

    For "bpe", returns the one saved in `workdir`, or None when none has been trained yet.
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        path = Path(workdir) / BPE_FILE
        return BPETokenizer.load(path) if path.exists() else None
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data.tokenizer={spec!r}: expected 'byte', 'bpe' or a tokenizer.json path")
    return BPETokenizer.load(path)
