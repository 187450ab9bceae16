"""Token data: corpus discovery, held-out split, deterministic batches.

Sources (`DataConfig.source`, comma-separated):
- "stdlib": the Python standard library's own `.py` sources (and its text docs where the
  installation ships them), found through `sysconfig`: a ~30 MB corpus on any machine
  with Python, no download.
- text files or folders (every file without NUL bytes in its first 8 KiB, hidden
  folders skipped);
- pre-tokenized token files: `.npy` (1-D integers), raw `.u16` / `.u32`, or raw `.bin`
  read as `DataConfig.token_dtype`. They are memory-mapped, never loaded whole.

Text files are held out by a hash of their path (relative to the source root), so the
split does not depend on the machine or on which other files exist. Token files hold out
the last `eval_percent` of their tokens.

The batch for step k is a pure function of (seed, k): resuming at step k replays the
same data order with no iterator state to save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np

from jax_twell.train.config import DataConfig
from jax_twell.train.tokenizer import BPE_FILE, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer

TOKEN_SUFFIXES = {".npy": None, ".u16": np.uint16, ".u32": np.uint32, ".bin": None}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and held-out token streams.

    train, eval: [n] unsigned integer tokens (possibly memory-mapped).
    eval_bytes: raw bytes behind `eval` (for bits per byte); 0 when unknown (token files).
    tokenizer: decodes samples; None for token files without a tokenizer.
    """

    train: np.ndarray
    eval: np.ndarray
    eval_bytes: int
    tokenizer: Tokenizer | None
    description: str


def stdlib_files() -> list[tuple[Path, str]]:
    """(path, name relative to the stdlib root) of the stdlib's `.py` files and text docs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        (p, p.relative_to(root).as_posix())
        for p in root.rglob("*.py")
        if "site-packages" not in p.relative_to(root).parts and p.is_file()
    ]
    doc_root = Path(sys.base_prefix) / "share" / "doc"
    for docs in sorted(doc_root.glob("python3*")) if doc_root.is_dir() else []:
        files += [
            (p, "doc/" + p.relative_to(doc_root).as_posix())
            for p in docs.rglob("*")
            if p.suffix in (".txt", ".rst") and p.is_file()
        ]
    return sorted(files, key=lambda f: f[1])


def text_files(root: Path) -> list[tuple[Path, str]]:
    """(path, relative name) of the text files under `root` (or `root` itself)."""
    if root.is_file():
        return [(root, root.name)]
    files = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        with open(p, "rb") as fh:
            if b"\0" in fh.read(8192):
                continue
        files.append((p, rel.as_posix()))
    return sorted(files, key=lambda f: f[1])


def is_held_out(name: str, eval_percent: float) -> bool:
    """Whether the file called `name` belongs to the held-out split (stable hash)."""
    bucket = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little") % 10_000
    return bucket < eval_percent * 100


def _load_token_file(path: Path, cfg: DataConfig) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            tokens = np.memmap(path, dtype=TOKEN_SUFFIXES[path.suffix] or np.dtype(cfg.token_dtype), mode="r")
    except (OSError, ValueError, EOFError) as e:  # numpy's errors do not always name the file
        raise ValueError(f"{path}: not a readable token file ({type(e).__name__}: {e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: token files must hold a 1-D integer array, got {tokens.dtype}{tokens.shape}")
    return tokens


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
    """Concatenation that keeps a single (memory-mapped) part uncopied."""
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0,), dtype)


def _load_token_sources(paths: list[Path], cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    train, held = [], []
    for path in paths:
        tokens = _load_token_file(path, cfg)
        cut = len(tokens) - int(len(tokens) * cfg.eval_percent / 100)
        train.append(tokens[:cut])
        held.append(tokens[cut:])
    dtype = np.result_type(*(t.dtype for t in train))
    names = ", ".join(p.name for p in paths)
    return Corpus(_concat(train, dtype), _concat(held, dtype), 0, tokenizer, f"token files {names}")


def _read_documents(files: list[tuple[Path, str]]) -> list[bytes]:
    return [path.read_bytes() for path, _ in files]  # OSError names the file


def load_corpus(cfg: DataConfig, workdir: str | Path, vocab_size: int, *, save_tokenizer: bool = True) -> Corpus:
    """Builds the training and held-out token streams described by `cfg`.

    A BPE tokenizer (`cfg.tokenizer == "bpe"`) is trained on the training split with
    `vocab_size` entries unless `workdir` already holds one, and saved there when
    `save_tokenizer` (set it on one process only). Raises ValueError when tokens do not fit
    `vocab_size` or a split is empty.
    """
    sources = [s.strip() for s in cfg.source.split(",") if s.strip()]
    if not sources:
        raise ValueError("data.source is empty")
    tokenizer = load_tokenizer(cfg.tokenizer, workdir)
    paths = [Path(s).expanduser() for s in sources if s != "stdlib"]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"data.source: {path} does not exist")
    token_paths = [p for p in paths if p.is_file() and p.suffix in TOKEN_SUFFIXES]
    if token_paths:
        if len(token_paths) != len(sources):
            raise ValueError("data.source: token files cannot be mixed with text sources")
        corpus = _load_token_sources(token_paths, cfg, tokenizer)
    else:
        files = []
        for source in sources:
            files += stdlib_files() if source == "stdlib" else text_files(Path(source).expanduser())
        train_files = [f for f in files if not is_held_out(f[1], cfg.eval_percent)]
        eval_files = [f for f in files if is_held_out(f[1], cfg.eval_percent)]
        train_docs, eval_docs = _read_documents(train_files), _read_documents(eval_files)
        if tokenizer is None:
            tokenizer = BPETokenizer.train(train_docs, vocab_size)
            if save_tokenizer:
                Path(workdir).mkdir(parents=True, exist_ok=True)
                tokenizer.save(Path(workdir) / BPE_FILE)
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32

        def encode(docs: list[bytes]) -> np.ndarray:
            if isinstance(tokenizer, ByteTokenizer):
                return np.frombuffer(b"".join(docs), dtype=np.uint8).astype(dtype)
            return _concat(tokenizer.encode_documents(docs), dtype)

        corpus = Corpus(
            encode(train_docs),
            encode(eval_docs),
            sum(len(d) for d in eval_docs),
            tokenizer,
            f"{len(train_files)} training / {len(eval_files)} held-out files from {cfg.source}",
        )
    for split, tokens in (("training", corpus.train), ("held-out", corpus.eval)):
        if len(tokens) == 0:
            raise ValueError(f"data.source={cfg.source!r}: the {split} split is empty (data.eval_percent={cfg.eval_percent})")
        if int(tokens.max()) >= vocab_size:
            raise ValueError(f"{split} tokens reach id {int(tokens.max())}, beyond the model's vocabulary of {vocab_size}")
    return corpus


def batch_at(
    tokens: np.ndarray, step: int, *, seed: int, batch_size: int, seq_len: int, rows: slice = slice(None)
) -> np.ndarray:
    """The training batch of `step`: a pure function of (seed, step).

    Returns rows `rows` (default all) of a [batch_size, seq_len + 1] int32 array of windows
    starting at uniformly drawn offsets of `tokens` (inputs are [:, :-1], targets [:, 1:]).
    """
    span = len(tokens) - seq_len - 1
    if span < 0:
        raise ValueError(f"{len(tokens)} tokens cannot fill one sequence of {seq_len + 1}")
    starts = np.random.default_rng([seed, step]).integers(0, span + 1, size=batch_size)[rows]
    return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)


def eval_batch(
    tokens: np.ndarray, index: int, *, num_batches: int, batch_size: int, seq_len: int, rows: slice = slice(None)
) -> np.ndarray:
    """Held-out batch `index` of `num_batches`: windows evenly spread over `tokens`.

    Returns [batch_size, seq_len + 1] int32 (rows `rows`); the same every time.
    """
    span = len(tokens) - seq_len - 1
    if span < 0:
        raise ValueError(f"the held-out split ({len(tokens)} tokens) cannot fill one sequence of {seq_len + 1}")
    starts = np.linspace(0, span, num_batches * batch_size).astype(np.int64)
    starts = starts[index * batch_size : (index + 1) * batch_size][rows]
    return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
