"""Data: corpus discovery, held-out split, token files, deterministic batches, tokenizers."""

import numpy as np
import pytest

from jax_twell.train import data
from jax_twell.train.config import DataConfig
from jax_twell.train.tokenizer import BPE_FILE, BPETokenizer, ByteTokenizer, load_tokenizer


def test_stdlib_corpus_is_found_and_split_by_path_hash():
    files = data.stdlib_files()
    names = [name for _, name in files]
    assert len(files) > 500 and "os.py" in names and names == sorted(names)
    held = [n for n in names if data.is_held_out(n, 2.0)]
    assert 0 < len(held) < 0.05 * len(names)
    assert held == [n for n in names if data.is_held_out(n, 2.0)], "the split is deterministic"
    assert not any(data.is_held_out(n, 0.0) for n in names)


@pytest.fixture
def text_dir(tmp_path):
    root = tmp_path / "texts"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    for i in range(30):
        (root / ("sub" if i % 2 else "") / f"f{i}.txt").write_text(f"document {i} " * 50)
    (root / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (root / ".hidden" / "secret.txt").write_text("hidden")
    return root


def test_text_folder_corpus(text_dir, tmp_path):
    names = [n for _, n in data.text_files(text_dir)]
    assert "blob.bin" not in names and not any("hidden" in n for n in names) and "sub/f1.txt" in names
    corpus = data.load_corpus(DataConfig(source=str(text_dir), eval_percent=20), tmp_path, 256)
    assert isinstance(corpus.tokenizer, ByteTokenizer)
    assert corpus.eval_bytes == len(corpus.eval) > 0
    total = sum(len(p.read_bytes()) for p, _ in data.text_files(text_dir))
    assert len(corpus.train) + len(corpus.eval) == total
    assert corpus.tokenizer.decode(corpus.train[:9]) == "document "


def test_token_files(tmp_path):
    tokens = np.arange(1000, dtype=np.uint32) % 300
    np.save(tmp_path / "t.npy", tokens)
    tokens.astype(np.uint16).tofile(tmp_path / "t.u16")
    tokens.tofile(tmp_path / "t.u32")
    tokens.astype(np.uint16).tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.u16", "t.u32", "t.bin"):
        corpus = data.load_corpus(DataConfig(source=str(tmp_path / name), eval_percent=10), tmp_path, 300)
        np.testing.assert_array_equal(corpus.train, tokens[:900], err_msg=name)
        np.testing.assert_array_equal(corpus.eval, tokens[900:], err_msg=name)
        assert corpus.eval_bytes == 0
    with pytest.raises(ValueError, match="vocabulary"):
        data.load_corpus(DataConfig(source=str(tmp_path / "t.npy")), tmp_path, 256)
    with pytest.raises(ValueError, match="mixed"):
        data.load_corpus(DataConfig(source=f"{tmp_path / 't.npy'},stdlib"), tmp_path, 300)
    with pytest.raises(FileNotFoundError):
        data.load_corpus(DataConfig(source=str(tmp_path / "missing")), tmp_path, 300)


def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    b = data.batch_at(tokens, 5, seed=1, batch_size=8, seq_len=16)
    assert b.shape == (8, 17) and b.dtype == np.int32
    np.testing.assert_array_equal(b[:, 1:], b[:, :-1] + 1)  # contiguous windows
    np.testing.assert_array_equal(b, data.batch_at(tokens, 5, seed=1, batch_size=8, seq_len=16))
    assert not np.array_equal(b, data.batch_at(tokens, 6, seed=1, batch_size=8, seq_len=16))
    assert not np.array_equal(b, data.batch_at(tokens, 5, seed=2, batch_size=8, seq_len=16))
    np.testing.assert_array_equal(b[2:6], data.batch_at(tokens, 5, seed=1, batch_size=8, seq_len=16, rows=slice(2, 6)))
    with pytest.raises(ValueError):
        data.batch_at(tokens[:10], 0, seed=0, batch_size=1, seq_len=16)


def test_eval_batches_are_fixed_and_cover_the_split():
    tokens = np.arange(10_000, dtype=np.uint16)
    batches = [data.eval_batch(tokens, i, num_batches=4, batch_size=2, seq_len=16) for i in range(4)]
    starts = np.concatenate([b[:, 0] for b in batches])
    assert starts[0] == 0 and starts[-1] == 10_000 - 17 and np.all(np.diff(starts) > 0)
    np.testing.assert_array_equal(batches[1], data.eval_batch(tokens, 1, num_batches=4, batch_size=2, seq_len=16))


def test_bpe_tokenizer_trains_saves_and_round_trips(text_dir, tmp_path):
    pytest.importorskip("tokenizers")
    workdir = tmp_path / "run"
    corpus = data.load_corpus(DataConfig(source=str(text_dir), tokenizer="bpe", eval_percent=20), workdir, 300)
    assert (workdir / BPE_FILE).exists() and isinstance(corpus.tokenizer, BPETokenizer)
    assert corpus.tokenizer.vocab_size <= 300
    train_bytes = sum(len(p.read_bytes()) for p, _ in data.text_files(text_dir)) - corpus.eval_bytes
    assert len(corpus.train) < train_bytes / 2, "BPE compresses the repetitive text"
    reloaded = load_tokenizer("bpe", workdir)
    text = "document 12 document 3"
    assert reloaded.decode(reloaded.encode(text.encode())) == text
    np.testing.assert_array_equal(
        data.load_corpus(DataConfig(source=str(text_dir), tokenizer="bpe", eval_percent=20), workdir, 300).train,
        corpus.train,
    )
