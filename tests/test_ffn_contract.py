"""One contract, every backend: the FFN ops' tests as a class each implementation
subclasses (reference, xla, cuda), on the named specs of :mod:`jax_twell.testing` with the
tolerances of tests/specs.py. A new backend gets every test by subclassing."""

import jax
import jax.numpy as jnp
import pytest

import jax_twell as jt
from jax_twell.ops.ffn.api import sparse_ffn_for_layer
from jax_twell.ops.ffn_train.api import sparse_ffn_train_for_layer
from jax_twell.ops.plan import FFNOptions, LayerInfo, Side, TrainOptions
from jax_twell.testing import synthetic_ffn_inputs
from specs import CPU_SPECS, GPU_SPECS, assert_close, fused_tolerance, tolerance

L1 = 0.37  # any non-zero coefficient: the L1 term's gradient is part of the contract


def dense_ffn(x, w_gate, w_up, w_down):
    """The FFN in plain f32 JAX: ``(y, L1 term)`` (docs/design.md, section 1, The job)."""
    x, w_up, w_down = (a.astype(jnp.float32) for a in (x, w_up, w_down))
    with jax.default_matmul_precision("highest"):  # f32 products, not TF32's, on GPUs
        h = jax.nn.relu(x @ w_up) if w_gate is None else jax.nn.relu(x @ w_gate.astype(jnp.float32)) * (x @ w_up)
        return h @ w_down, jnp.abs(h).sum(-1).mean()


def inputs(spec, gated, dtype, seed=0):
    inp = synthetic_ffn_inputs(jax.random.key(seed), spec.m, spec.d, spec.f, density=spec.density,
                               pattern=spec.pattern, dtype=dtype)
    return inp._replace(w_gate=inp.w_gate if gated else None, w_up=inp.w_up if gated else inp.w_gate)


def pytest_generate_tests(metafunc):
    """``spec`` runs over the class's specs (``train_spec`` over those its training op takes)."""
    cls = metafunc.cls
    if cls is None:
        return
    if "spec" in metafunc.fixturenames:
        metafunc.parametrize("spec", cls.specs, ids=str)
    if "train_spec" in metafunc.fixturenames:
        metafunc.parametrize("train_spec", [s for s in cls.specs if cls.trains(s)], ids=str)


class FFNContract:
    """What every implementation of ``sparse_ffn`` / ``sparse_ffn_train`` must do."""

    implementation: str
    specs = CPU_SPECS
    dtypes = (jnp.float32, jnp.bfloat16)
    layer = LayerInfo()  # what the calls are told about the layer
    options = FFNOptions(tile=64, capacity=4)
    train_options = TrainOptions(width=16)
    tolerance_factor = 1  # fused kernels round g, u and h each: twice the plain tolerance

    @staticmethod
    def trains(spec) -> bool:
        return True

    def ffn(self, x, w_gate, w_up, w_down):
        return sparse_ffn_for_layer(x, w_gate, w_up, w_down, implementation=self.implementation, layer=self.layer,
                                    options=self.options)

    def ffn_train(self, x, w_gate, w_up, w_down):
        y, aux = sparse_ffn_train_for_layer(x, w_gate, w_up, w_down, implementation=self.implementation,
                                            layer=self.layer, options=self.train_options)
        return y, aux.l1

    @pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
    def test_inference_is_the_dense_formula(self, spec, gated):
        for dtype in self.dtypes:
            inp = inputs(spec, gated, dtype)
            y = jax.jit(self.ffn)(*inp)
            assert y.shape == inp.x.shape and y.dtype == dtype
            tol = self.tolerance_factor * tolerance(dtype, spec.d + spec.f)
            assert_close(y, dense_ffn(*inp)[0], tol, f"{self.implementation} {jnp.dtype(dtype).name}")

    def test_leading_dims_and_vmap(self):
        spec = self.specs[0]
        inp = inputs(spec, True, jnp.float32, seed=5)
        want = dense_ffn(*inp)[0]
        tol = self.tolerance_factor * tolerance(jnp.float32, spec.d + spec.f)
        x = jnp.tile(inp.x[None, None], (2, 3, 1, 1))
        y = jax.jit(lambda x: self.ffn(x, *inp[1:]))(x)
        assert y.shape == x.shape
        assert_close(y[1, 2], want, tol, "leading dims")
        yv = jax.vmap(lambda x: self.ffn(x, *inp[1:]))(x.reshape(6, *inp.x.shape))
        assert_close(yv[4], want, tol, "vmap")

    @pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
    def test_inference_gradients_are_the_dense_formulas(self, gated):
        spec = self.specs[0]
        inp = inputs(spec, gated, jnp.float32, seed=7)
        cot = jax.random.normal(jax.random.key(8), inp.x.shape)
        argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
        got = jax.grad(lambda *a: (self.ffn(*a) * cot).sum(), argnums)(*inp)
        want = jax.grad(lambda *a: (dense_ffn(*a)[0] * cot).sum(), argnums)(*inp)
        for g, w in zip(got, want):
            assert_close(g, w, self.tolerance_factor * tolerance(jnp.float32, spec.d + spec.f, grad=True), "grad")

    @pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
    def test_training_is_the_dense_formula_and_its_gradients(self, train_spec, gated):
        spec = train_spec
        inp = inputs(spec, gated, jnp.float32, seed=1)
        cot = jax.random.normal(jax.random.key(2), inp.x.shape)
        objective = lambda fn: lambda *a: (fn(*a)[0] * cot).sum() + L1 * fn(*a)[1]
        argnums = (0, 1, 2, 3) if gated else (0, 2, 3)
        got = jax.jit(jax.grad(objective(self.ffn_train), argnums))(*inp)
        want = jax.grad(objective(dense_ffn), argnums)(*inp)
        n = spec.d + spec.f + spec.m
        for g, w in zip(got, want):
            assert_close(g, w, self.tolerance_factor * tolerance(jnp.float32, n, grad=True), "train grad")
        y, l1 = self.ffn_train(*inp)
        y_want, l1_want = dense_ffn(*inp)
        assert_close(y, y_want, self.tolerance_factor * tolerance(jnp.float32, n), "train y")
        assert_close(l1, l1_want, self.tolerance_factor * tolerance(jnp.float32, n), "l1")


class TestReference(FFNContract):
    implementation = "reference"


class TestXla(FFNContract):
    implementation = "xla"


@pytest.mark.gpu
class TestCuda(FFNContract):
    """The kernels, told the layer's side is sparse (the default rule runs these small
    shapes dense); bf16 and f32 inference (f32 through the row kernel), bf16 training (f32
    runs XLA autodiff)."""

    implementation = "cuda"
    specs = GPU_SPECS
    layer = LayerInfo(side=Side.SPARSE)
    options = FFNOptions()
    train_options = TrainOptions()
    tolerance_factor = 2
    dtypes = (jnp.bfloat16,)

    @staticmethod
    def trains(spec) -> bool:
        return spec.d % 64 == 0  # the training kernels' constraint

    def test_implementation_none_takes_the_kernels(self):
        spec = self.specs[0]
        inp = inputs(spec, True, jnp.bfloat16)
        hlo = jax.jit(lambda *a: sparse_ffn_for_layer(*a, layer=self.layer)).lower(*inp).as_text()
        assert "jax_twell_" in hlo
        assert_close(jt.sparse_ffn(*inp), dense_ffn(*inp)[0], fused_tolerance(jnp.bfloat16, spec.f), "public op")
