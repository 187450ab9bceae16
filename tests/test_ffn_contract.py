"""One contract, every backend: the FFN ops' tests as a class each implementation
subclasses (reference, xla, cuda), on the named specs of :mod:`jax_twell.testing` with the
tolerances of tests/specs.py. A new backend gets every test by subclassing."""

import jax
import jax.numpy as jnp
import numpy as np
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

    @pytest.fixture(autouse=True)
    def _f32_products(self):
        """f32 matmuls in f32 (on GPUs XLA's default is TF32) for the oracle and the XLA
        sides alike: the contract is the dense formula's, at each dtype's own precision."""
        with jax.default_matmul_precision("highest"):
            yield

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


    @staticmethod
    def _poisoned(inp, case):
        """The operands with one NaN or Inf placed as ``case`` names (module docstring of
        tests: what the dense formula makes of it is the contract)."""
        x, w_gate, w_up, w_down = inp
        w_act = w_up if w_gate is None else w_gate
        fired = (jax.nn.relu(x.astype(jnp.float32) @ w_act.astype(jnp.float32)) > 0).sum(0)
        quiet = int(jnp.argmin(fired))  # the neuron that fires least (never, where one exists)
        if case == "nan_w_up_quiet":
            return x, w_gate, w_up.at[3, quiet].set(jnp.nan), w_down
        if case == "inf_w_down_quiet":
            return x, w_gate, w_up, w_down.at[quiet, 1].set(jnp.inf)
        if case == "nan_x_row":
            return x.at[0, 2].set(jnp.nan), w_gate, w_up, w_down
        if case == "inf_x_row":
            return x.at[-1, 0].set(-jnp.inf), w_gate, w_up, w_down
        if case == "nan_w_act":
            return (x, w_gate.at[1, quiet].set(jnp.nan), w_up, w_down) if w_gate is not None else \
                (x, w_gate, w_up.at[1, quiet].set(jnp.nan), w_down)
        raise ValueError(case)

    NONFINITE = ("nan_w_up_quiet", "inf_w_down_quiet", "nan_x_row", "inf_x_row", "nan_w_act")

    @staticmethod
    def _assert_same_nonfinite(got, want, tol, what):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        bad = ~np.isfinite(want)
        assert bad.any(), f"{what}: the case must make the dense formula non-finite somewhere"
        np.testing.assert_array_equal(~np.isfinite(got), bad, err_msg=f"{what}: NaN/Inf where the dense formula has them")
        if (~bad).any():
            assert_close(np.where(bad, 0, got), np.where(bad, 0, want), tol, what)

    @pytest.mark.parametrize("case", NONFINITE)
    @pytest.mark.parametrize("gated", [True, False], ids=["gated", "nongated"])
    def test_inference_nan_and_inf_as_the_dense_formula(self, spec, gated, case):
        if case == "nan_w_up_quiet" and not gated:
            pytest.skip("non-gated: w_up is the activation's weight (nan_w_act)")
        dtype = self.dtypes[-1]
        inp = self._poisoned(inputs(spec, gated, dtype, seed=11), case)
        y = jax.jit(self.ffn)(*inp)
        tol = self.tolerance_factor * tolerance(dtype, spec.d + spec.f)
        self._assert_same_nonfinite(y, dense_ffn(*inp)[0], tol, f"{self.implementation} {case}")

    @pytest.mark.parametrize("case", NONFINITE + ("nan_cotangent",))
    def test_training_nan_and_inf_as_the_dense_formula(self, case):
        spec = next(s for s in self.specs if self.trains(s))
        dtype = self.dtypes[-1]
        inp = inputs(spec, True, dtype, seed=12)
        cot = jax.random.normal(jax.random.key(13), inp.x.shape, jnp.float32)
        if case == "nan_cotangent":
            cot = cot.at[1, 3].set(jnp.nan)
        else:
            inp = self._poisoned(inp, case)
        objective = lambda fn: lambda *a: (fn(*a)[0].astype(jnp.float32) * cot).sum() + L1 * fn(*a)[1]
        got = jax.jit(jax.grad(objective(self.ffn_train), (0, 1, 2, 3)))(*inp)
        want = jax.grad(objective(dense_ffn), (0, 1, 2, 3))(*inp)
        for name, g, w in zip(("dx", "dw_gate", "dw_up", "dw_down"), got, want):
            mask_got, mask_want = ~np.isfinite(np.asarray(g, np.float64)), ~np.isfinite(np.asarray(w, np.float64))
            np.testing.assert_array_equal(mask_got, mask_want, err_msg=f"{self.implementation} {case} {name}")
        if case != "nan_cotangent":
            y, _ = jax.jit(self.ffn_train)(*inp)
            n = spec.d + spec.f + spec.m
            self._assert_same_nonfinite(y, dense_ffn(*inp)[0], self.tolerance_factor * tolerance(dtype, n),
                                        f"{self.implementation} {case} train y")


class TestReference(FFNContract):
    implementation = "reference"


class TestXla(FFNContract):
    implementation = "xla"


class TestCpu(FFNContract):
    """The CPU kernels, forced on: for inference their own dense side runs where g is not
    sparse enough and plain f32 calls of few tokens run dense entirely (jax_twell.ops.ffn.cpu);
    for training the kernels are told the layer's side is sparse (the default rule runs
    these small shapes dense: jax_twell.ops.ffn_train.cpu). tests/test_cpu_kernels.py covers
    the kernels' own sides."""

    implementation = "cpu"
    tolerance_factor = 2

    @pytest.fixture(autouse=True)
    def _cpu_kernels(self):
        from jax_twell import _cpu

        if not _cpu.cpu_kernels_available():
            pytest.skip(f"CPU kernels unavailable: {_cpu.cpu_kernel_status().reason}")

    def ffn_train(self, x, w_gate, w_up, w_down):
        y, aux = sparse_ffn_train_for_layer(x, w_gate, w_up, w_down, implementation=self.implementation,
                                            layer=LayerInfo(side=Side.SPARSE), options=self.train_options)
        return y, aux.l1

    def ffn(self, x, w_gate, w_up, w_down):
        """With the weights' finite columns kept (a serving layer's cache), so that calls of
        every size run the kernel where g is sparse enough."""
        from jax_twell.ops.common import finite_columns

        ok = finite_columns(w_up if w_gate is not None else None, w_down)
        return sparse_ffn_for_layer(x, w_gate, w_up, w_down, implementation=self.implementation, layer=self.layer,
                                    options=self.options, weights_finite=ok)


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
