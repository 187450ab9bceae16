"""The weights stored by neuron a layer may keep (``w_up_t``, ``w_act_t``; the internal
entry point ``sparse_ffn_for_layer``, which the Flax module calls): checked, passed to the
CUDA path (per shard under a mesh, split like w_down), ignored by the others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_twell as jt
from jax_twell.ops import common
from jax_twell.ops.ffn import api as ffn_api
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.testing import synthetic_ffn_inputs
from jax_twell.ops import xla


def _inputs():
    return synthetic_ffn_inputs(jax.random.key(3), 32, 64, 256, density=0.05)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_other_implementations_ignore_it(impl):
    inp = _inputs()
    a = sparse_ffn_for_layer(*inp, implementation=impl)
    b = sparse_ffn_for_layer(*inp, implementation=impl, w_up_t=inp.w_up.T, w_act_t=inp.w_gate.T)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bad_w_up_t_is_refused():
    inp = _inputs()
    with pytest.raises(ValueError, match="gated FFN only"):
        sparse_ffn_for_layer(inp.x, None, inp.w_up, inp.w_down, w_up_t=inp.w_up.T)
    with pytest.raises(ValueError, match="must be w_up.T"):
        sparse_ffn_for_layer(*inp, w_up_t=inp.w_up)
    with pytest.raises(ValueError, match="must be w_up.T"):
        sparse_ffn_for_layer(*inp, w_up_t=inp.w_up.T.astype(jnp.float32))


def test_bad_w_act_t_is_refused():
    inp = _inputs()
    with pytest.raises(ValueError, match="must be w_gate.T"):
        sparse_ffn_for_layer(*inp, w_act_t=inp.w_gate)
    with pytest.raises(ValueError, match="must be w_gate.T"):
        sparse_ffn_for_layer(*inp, w_act_t=inp.w_gate.T.astype(jnp.float32))
    with pytest.raises(ValueError, match="must be w_up.T"):
        sparse_ffn_for_layer(inp.x, None, inp.w_up, inp.w_down, w_act_t=inp.w_up)
    # Non-gated, the activation's weight is w_up: its transpose is accepted.
    y = sparse_ffn_for_layer(inp.x, None, inp.w_up, inp.w_down, implementation="xla", w_act_t=inp.w_up.T)
    assert y.shape == inp.x.shape


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """The CUDA implementation's entry replaced by XLA's FFN, recording the w_up_t and w_act_t it is given
    and computing from them where given (so a wrong slice shows in y)."""
    seen = []

    def stand_in(x, w_gate, w_up, w_down, *, layer, options, w_up_t=None, w_act_t=None, **_):
        seen.append(None if w_up_t is None else (w_up_t.shape, w_up.shape))
        if w_up_t is not None:  # the right slice of w_up.T, per shard too
            w_up = w_up_t.T
        if w_act_t is not None:
            seen.append(("w_act_t", w_act_t.shape))
            w_gate = w_act_t.T
        return xla.ffn(x, w_gate, w_up, w_down)

    monkeypatch.setattr(ffn_api.cuda, "sparse_ffn", stand_in)
    monkeypatch.setattr(common._kernels, "kernels_available", lambda: True)
    return seen


def test_cuda_path_receives_it(cuda_stand_in):
    inp = _inputs()
    y = jax.jit(lambda *a: sparse_ffn_for_layer(*a[:4], implementation="cuda", w_up_t=a[4]))(*inp, inp.w_up.T)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(xla.ffn(*inp), np.float32), rtol=0, atol=0)
    assert cuda_stand_in == [((256, 64), (64, 256))]
    sparse_ffn_for_layer(*inp, implementation="cuda")
    assert cuda_stand_in[-1] is None


def test_default_implementation_takes_them(cuda_stand_in):
    """implementation=None with kernels available: the platform switch (here on CPU, XLA)
    takes both optional weights."""
    inp = _inputs()
    y = jax.jit(lambda *a: sparse_ffn_for_layer(*a[:4], w_up_t=a[4], w_act_t=a[5]))(*inp, inp.w_up.T, inp.w_gate.T)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(xla.ffn(*inp), np.float32), rtol=0, atol=0)
    y = sparse_ffn_for_layer(inp.x, None, inp.w_up, inp.w_down, w_act_t=inp.w_up.T)
    assert y.shape == inp.x.shape


@pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 host devices")
def test_sharded_cuda_path_gets_local_rows(cuda_stand_in):
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices("cpu")[:4])
    sharding = jt.FFNSharding(token_axes=("data",), tensor_axis="tensor", mesh=mesh)
    inp = _inputs()
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (
        put(inp.x, P("data", None)), put(inp.w_gate, P(None, "tensor")), put(inp.w_up, P(None, "tensor")),
        put(inp.w_down, P("tensor", None)), put(inp.w_up.T, P("tensor", None)), put(inp.w_gate.T, P("tensor", None)),
    )
    fn = jax.jit(
        lambda x, wg, wu, wd, wut, wat: sparse_ffn_for_layer(
            x, wg, wu, wd, implementation="cuda", sharding=sharding, w_up_t=wut, w_act_t=wat
        )
    )
    y = fn(*args)
    want = xla.ffn(*inp)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    ups = [s for s in cuda_stand_in if s[0] != "w_act_t"]
    acts = [s for s in cuda_stand_in if s[0] == "w_act_t"]
    assert ups and all(s == ((128, 64), (64, 128)) for s in ups)  # f split over 2
    assert acts and all(s == ("w_act_t", (128, 64)) for s in acts)
