"""Reference packing and unpacking of TwELL and Hybrid: exact for every input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_twell as jt
from jax_twell.formats import relu_matmul
from jax_twell.testing import synthetic_ffn_inputs


def adversarial_activation(key, m, f, dtype=jnp.float32, tile=64):
    """[m, f] with empty rows, fully dense rows, one fully active tile, rows far over any
    capacity, sparse rows; values are non-zero where active (signs mixed on purpose)."""
    k1, k2, k3 = jax.random.split(key, 3)
    vals = jax.random.uniform(k1, (m, f), minval=0.5, maxval=2.0) * jnp.where(jax.random.bernoulli(k3, 0.2, (m, f)), -1, 1)
    keep = jax.random.bernoulli(k2, 0.03, (m, f))
    keep = keep.at[0].set(False)  # empty row
    keep = keep.at[1].set(True)  # fully dense row
    keep = keep.at[2, :tile].set(True)  # one fully active tile
    keep = keep.at[3, ::2].set(True)  # far over capacity in every tile
    return jnp.where(keep, vals, 0).astype(dtype)


def twell_invariants(t: jt.TwELL, a):
    a = np.asarray(a, np.float32)
    m, f = a.shape[-2:]
    tiles = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, t.n_tiles * t.tile - f)]).reshape(*a.shape[:-1], t.n_tiles, t.tile)
    counts = (tiles != 0).sum(-1)
    np.testing.assert_array_equal(np.asarray(t.counts), counts)
    vals, cols = np.asarray(t.values, np.float32), np.asarray(t.cols)
    slot = np.arange(t.capacity)
    used = slot < counts[..., None]
    # Stored entries are the first non-zeros in column order; unused slots are zero.
    assert np.all(np.where(used[..., 1:] & used[..., :-1], np.diff(cols, axis=-1) > 0, True))
    np.testing.assert_array_equal(np.where(used, 0, vals), 0)
    np.testing.assert_array_equal(np.where(used, 0, cols), 0)
    np.testing.assert_array_equal(np.where(used, np.take_along_axis(tiles, cols.astype(np.int64), -1), 0), np.where(used, vals, 0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tile,capacity", [(64, 8), (32, 32), (256, 32), (96, 1)])
def test_twell_pack_exact_with_recompute(dtype, tile, capacity):
    inp = synthetic_ffn_inputs(jax.random.key(tile + capacity), 45, 24, 333, density=0.05, pattern="heavy", dtype=dtype)
    a = relu_matmul(inp.x, inp.w_gate)
    t = jt.pack_twell(a, tile=tile, capacity=capacity)
    assert t.values.shape == (45, -(-333 // tile), capacity) and t.values.dtype == dtype
    twell_invariants(t, a)
    np.testing.assert_array_equal(t.to_dense(inp.x, inp.w_gate), a)


def test_twell_adversarial_rows():
    a = adversarial_activation(jax.random.key(0), 9, 200, tile=64)
    t = jt.pack_twell(a, tile=64, capacity=4)
    twell_invariants(t, a)
    over = np.asarray(t.overflowed)
    assert over[1].all() and over[3, :3].all() and over[2, 0] and not over[0].any()
    dense = np.asarray(t.to_dense())
    # Without the source, exactly the overflowed tiles are NaN; everything else is exact.
    tile_nan = np.isnan(np.pad(dense, [(0, 0), (0, 56)]).reshape(9, 4, 64)).any(-1)
    np.testing.assert_array_equal(tile_nan, over)
    ok = ~np.isnan(dense)
    np.testing.assert_array_equal(dense[ok], np.asarray(a)[ok])
    # With a capacity that fits every tile, nothing is flagged and to_dense is exact.
    full = jt.pack_twell(a, tile=64, capacity=64)
    assert not np.asarray(full.overflowed).any()
    np.testing.assert_array_equal(full.to_dense(), a)


def test_twell_leading_dims_jit_vmap():
    a = adversarial_activation(jax.random.key(1), 24, 130, tile=32).reshape(2, 3, 4, 130)
    t = jax.jit(lambda a: jt.pack_twell(a, tile=32, capacity=8))(a)
    assert t.values.shape == (2, 3, 4, 5, 8)
    twell_invariants(t, a)
    tv = jax.vmap(lambda a: jt.pack_twell(a, tile=32, capacity=8))(a.reshape(6, 4, 130))
    np.testing.assert_array_equal(tv.values.reshape(t.values.shape), t.values)
    full = jt.pack_twell(a, tile=32, capacity=32)
    np.testing.assert_array_equal(jax.jit(lambda t: t.to_dense())(full), a)


@pytest.mark.parametrize("width,backup", [(4, None), (4, 2), (300, 0), (1, 0)])
def test_hybrid_pack_exact(width, backup):
    a = adversarial_activation(jax.random.key(2), 12, 150)
    h = jt.pack_hybrid(a, width=width, backup_capacity=backup)
    counts = np.asarray((a != 0).sum(-1))
    np.testing.assert_array_equal(h.counts, counts)
    over = counts > width
    assert int(h.n_overflow) == over.sum()
    b = h.backup_capacity
    assert bool(h.complete) == (over.sum() <= b)
    # The backup holds the first overflowing rows in row order.
    expected_rows = np.flatnonzero(over)[:b]
    np.testing.assert_array_equal(np.asarray(h.backup_rows)[: len(expected_rows)], expected_rows)
    assert np.all(np.asarray(h.backup_rows)[len(expected_rows):] == a.shape[0])
    dense = np.asarray(h.to_dense())
    missing = over.copy()
    missing[expected_rows] = False
    assert np.isnan(dense[missing]).all() and not np.isnan(dense[~missing]).any()
    np.testing.assert_array_equal(dense[~missing], np.asarray(a)[~missing])


@pytest.mark.slow
def test_hybrid_recompute_from_source_and_batch():
    inp = synthetic_ffn_inputs(jax.random.key(3), 40, 16, 100, density=0.1, pattern="heavy")
    a = relu_matmul(inp.x, inp.w_gate)
    h = jt.pack_hybrid(a, width=5, backup_capacity=1)
    assert not bool(h.complete)
    np.testing.assert_array_equal(h.to_dense(inp.x, inp.w_gate), a)
    batched = jt.pack_hybrid(a.reshape(4, 10, 100), width=5, backup_capacity=10)
    assert batched.values.shape == (4, 10, 5) and batched.backup_values.shape == (4, 10, 100)
    np.testing.assert_array_equal(batched.to_dense(), a.reshape(4, 10, 100))


def test_pack_bad_inputs():
    a = jnp.ones((4, 64))
    with pytest.raises(ValueError, match="tile must be a positive multiple of 32"):
        jt.pack_twell(a, tile=48)
    with pytest.raises(ValueError, match="capacity must be an int in"):
        jt.pack_twell(a, tile=32, capacity=33)
    with pytest.raises(TypeError, match="a must be bf16, f16 or f32"):
        jt.pack_twell(jnp.ones((4, 64), jnp.int32))
    with pytest.raises(ValueError, match="a must have shape"):
        jt.pack_twell(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"a must have shape \[..., M, f\]"):
        jt.pack_hybrid(jnp.ones((64,)))
    with pytest.raises(ValueError, match="width must be a positive int"):
        jt.pack_hybrid(a, width=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jt.pack_twell(a, implementation="triton")


@pytest.mark.parametrize("width,backup", [(4, None), (4, 2), (300, 0), (64, 5)])
def test_hybrid_from_one_tile_per_row_twell(width, backup):
    """The CUDA hybrid pack (TwELL with one tile per row, then the backup) is the reference."""
    from jax_twell.formats import hybrid_from_row_twell, pack_twell_reference

    a = adversarial_activation(jax.random.key(7), 12, 150).reshape(2, 6, 150)
    row_tile = 160
    rows = pack_twell_reference(a, tile=row_tile, capacity=min(width, row_tile))
    got = hybrid_from_row_twell(rows, a, width=width, backup_capacity=backup)
    want = jt.pack_hybrid(a, width=width, backup_capacity=backup, implementation="reference")
    for name in ("values", "cols", "counts", "backup_values", "backup_rows"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_array_equal(g, w, err_msg=name)


def _packed():
    a = jnp.asarray(adversarial_activation(jax.random.key(3), 9, 200, tile=64))
    return jt.formats.pack_twell_reference(a, tile=64, capacity=4), a


def _first_used(counts, limit):
    """Index of the first row (and tile) whose first slot is used and whose count fits `limit`."""
    counts = np.asarray(counts)
    return tuple(np.argwhere((counts >= 2) & (counts <= limit))[0])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, i: dict(cols=t.cols.at[i + (0,)].set(64)), "cols of stored entries must be in \\[0, tile\\)"),
        (lambda t, i: dict(cols=t.cols.at[i + (0,)].set(-3)), "cols of stored entries must be in \\[0, tile\\)"),
        (lambda t, i: dict(cols=t.cols.at[i + (1,)].set(0)), "strictly ascending"),
        (lambda t, i: dict(counts=t.counts.at[i].set(-1)), "counts must be >= 0"),
        (lambda t, i: dict(counts=t.counts.at[i].set(65)), "counts exceed the columns of their tile"),
        (lambda t, i: dict(f=1000), "f=1000 with tile=64 needs 16 tiles, values hold 4"),
        (lambda t, i: dict(f=0), "f must be a positive int"),
        (lambda t, i: dict(tile=0), "tile must be a positive multiple of 32 and at most 32768"),
        (lambda t, i: dict(tile=65536), "tile must be a positive multiple of 32 and at most 32768"),
        (lambda t, i: dict(counts=t.counts[:, :2]), "counts shape \\(9, 2\\) != values shape without capacity"),
        (lambda t, i: dict(cols=t.cols[..., :2]), "cols shape .* != values shape"),
        (lambda t, i: dict(cols=t.cols.astype(jnp.float32)), "cols must be integers"),
    ],
)
def test_hand_built_twell_with_inconsistent_fields_is_rejected(change, message):
    t, _ = _packed()
    t.validate()  # the packed one is consistent
    i = _first_used(t.counts, 4)
    with pytest.raises(ValueError, match="inconsistent TwELL: .*" + message):
        dataclasses.replace(t, **change(t, i))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, r: dict(cols=h.cols.at[r, 0].set(200)), "cols of stored entries must be in \\[0, f=200\\)"),
        (lambda h, r: dict(cols=h.cols.at[r, 1].set(h.cols[r, 0])), "strictly ascending"),
        (lambda h, r: dict(counts=h.counts.at[r].set(-2)), "counts must be in \\[0, f=200\\]"),
        (lambda h, r: dict(backup_rows=h.backup_rows.at[0].set(-1)), "backup_rows must be in \\[0, M=9\\]"),
        (lambda h, r: dict(backup_rows=h.backup_rows.at[0].set(10)), "backup_rows must be in \\[0, M=9\\]"),
        (lambda h, r: dict(backup_rows=h.backup_rows[::-1]), "ascending order, then M=9"),
        (lambda h, r: dict(backup_rows=jnp.full_like(h.backup_rows, 9).at[0].set(r)), "rows whose count exceeds width=8"),
        (lambda h, r: dict(backup_values=h.backup_values[:, :5]), "backup_values must be \\[..., B, f=200\\]"),
        (lambda h, r: dict(backup_rows=h.backup_rows[:2]), "backup_rows shape \\(2,\\) != \\(3,\\)"),
        (lambda h, r: dict(f=0), "f must be a positive int"),
    ],
)
def test_hand_built_hybrid_with_inconsistent_fields_is_rejected(change, message):
    a = jnp.asarray(adversarial_activation(jax.random.key(3), 9, 200, tile=64))
    h = jt.formats.pack_hybrid_reference(a, width=8, backup_capacity=3)
    h.validate()
    r = int(_first_used(h.counts, 8)[0])
    with pytest.raises(ValueError, match="inconsistent Hybrid: .*" + message):
        dataclasses.replace(h, **change(h, r))


def test_checks_skip_contents_under_tracing_and_pytree_rebuilds():
    t, a = _packed()
    # Inside jit the arrays are tracers: only static fields and shapes are checked.
    shifted = jax.jit(lambda t: dataclasses.replace(t, cols=t.cols + 100))(t)
    assert int(shifted.cols.max()) >= 100, "a jit output is rebuilt without the constructor's checks"
    specs = jax.tree.map(lambda x: None, t)  # pytree stand-ins never go through the checks
    assert specs.tile == t.tile
    abstract = jax.eval_shape(lambda a: jt.formats.pack_twell_reference(a, tile=64, capacity=4), a)
    assert abstract.values.shape == t.values.shape
    np.testing.assert_array_equal(jax.vmap(lambda t: t.to_dense())(jax.tree.map(lambda x: x[None], t))[0],
                                  t.to_dense())
    with pytest.raises(ValueError, match="tile must be"):
        jax.jit(lambda t: dataclasses.replace(t, tile=48))(t)
