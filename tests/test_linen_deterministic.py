"""The Linen SparseFFN takes Flax's `deterministic` (call argument or attribute); `inference=` is its deprecated alias."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from jax_twell import linen

F = 64


@pytest.fixture(scope="module")
def setup():
    x = jax.random.normal(jax.random.key(1), (2, 5, 32))
    module = linen.SparseFFN(d_ff=F, width=16)
    params = nn.meta.unbox(module.init(jax.random.key(0), x)["params"])
    return module, params, x


def test_deterministic_takes_the_inference_path(setup):
    module, params, x = setup
    y_train, state = module.apply({"params": params}, x, mutable=["intermediates"])
    assert "ffn_stats" in state["intermediates"]
    y_det, state = module.apply({"params": params}, x, deterministic=True, mutable=["intermediates"])
    assert state == {} or not state.get("intermediates"), "the inference path sows nothing"
    np.testing.assert_allclose(y_det, y_train, rtol=1e-5, atol=1e-5)
    # The attribute is the default of the call argument, which overrides it.
    det_module = linen.SparseFFN(d_ff=F, width=16, deterministic=True)
    _, state = det_module.apply({"params": params}, x, mutable=["intermediates"])
    assert not state.get("intermediates")
    _, state = det_module.apply({"params": params}, x, deterministic=False, mutable=["intermediates"])
    assert "ffn_stats" in state["intermediates"]


def test_inference_is_a_deprecated_alias(setup):
    module, params, x = setup
    with pytest.warns(DeprecationWarning, match="deterministic"):
        y_old, state = module.apply({"params": params}, x, inference=True, mutable=["intermediates"])
    assert not state.get("intermediates")
    np.testing.assert_array_equal(y_old, module.apply({"params": params}, x, deterministic=True))
    with pytest.raises(ValueError, match="disagree"), pytest.warns(DeprecationWarning):
        module.apply({"params": params}, x, inference=True, deterministic=False)
