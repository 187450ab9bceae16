"""CPU checks of the warp path's row split (jax_twell/ops/warp.py): which rows the kernel
leaves to the dense backup, and the backup's static size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_twell.formats import pack_twell_reference
from jax_twell.ops.ffn import warp


def test_backed_up_rows_are_those_past_capacity_or_budget():
    m, f = 6, 512
    a = np.zeros((m, f), np.float32)
    a[1, :40] = 1.0            # 40 in tile 0: past capacity 32
    a[2, ::8] = 1.0            # 64 entries, 32 a tile: fits capacity, at the budget
    a[3, ::7] = 1.0            # 74 entries: past a 64-entry budget
    a[4, 300:310] = 1.0        # 10 entries
    act = pack_twell_reference(jnp.asarray(a, jnp.bfloat16), tile=256, capacity=32)
    got = np.asarray(warp.backed_up(act, 64))
    assert got.tolist() == [False, True, False, True, False, False]
    assert np.asarray(warp.backed_up(act, 9)).tolist() == [False, True, True, True, True, False]


@pytest.mark.parametrize("m", [1, 7, 8, 100, 2048, 16384, 65536])
def test_backup_size(m):
    b = warp.backup_size(m)
    assert 1 <= b <= m and (b == m or b % 8 == 0)
    assert b >= min(m, -(-m // 32))


def test_supported():
    assert warp.supported(2048, jnp.bfloat16) and warp.supported(8, jnp.float16)
    assert not warp.supported(2056, jnp.bfloat16)
    assert not warp.supported(2044, jnp.bfloat16)
    assert not warp.supported(2048, jnp.float32)
