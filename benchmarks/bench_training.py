"""Training FFN benchmark: forward + backward (with the L1 term) of the CUDA training op
against XLA's dense autodiff, same process, same inputs: docs/design.md, section 7
(Benchmark protocol).

Per configuration (M=16384, d=2048, f=5632, bf16; densities 0.25/0.5/1/2/5%; uniform and heavy
rows; synthetic sparsity through a real gate matmul), each timing the median of many
synchronised runs after warm-up, never on zeros; the step variants of a configuration are
timed in interleaved rounds (each round times every variant once, so a drift of the GPU
clock falls on all alike; ``<variant>_step_spread``: interquartile range / median):
A step is ``jax.value_and_grad`` of ``sum(y * cot) + L1 * l1`` (the loss and the gradients
of x and the three weights), as a training loop takes it: the loss needs y, so XLA's dense
step runs all nine matmuls (the forward's three, the backward's six). With ``--grad-only``,
``jax.grad`` alone, as before 2026-12-02: there XLA drops the dense forward's down matmul
(y itself feeds no gradient), while the kernels' forward computes y either way, so the
ratios read ~10% lower than a training step's.

- dense: XLA autodiff through jax_twell.ops.xla.ffn_with_aux;
- cuda: cuda_train.ffn_with_aux forced sparse, CUDA-core steps (mma=False; margin inf: sparse wherever the entries
  fit the budget; "branch" says which path ran);
- auto: cuda_train.ffn_with_aux under the default rule (TrainCrossover), decided per call
  on the device;
- layer: the same rule decided at trace time from the measured active fraction and 64-token
  union (``active_fraction=``, ``union_fraction=``, as the bundled training loop decides
  each layer's side): XLA autodiff where the rule says dense, the kernels where it says sparse;
- mma: as cuda, with the up, down, dh and dx steps on tensor cores (mma=True, the default
  of ffn_with_aux; auto and layer use it);
- cdx (with --cudacore-dx): as mma, with dx on CUDA cores (dx_mma=False);
- udx (with --union-dx): as mma, with dx as a union product (dx_union=True);
- udn (with --union-down): as mma, with the forward's down step as a union product too (down_union=True);
- uup (with --union-up): as mma, with the forward's up step as a union product too (up_union=True);
- pdh (with --per-entry-dh): as mma, with the backward's dh step per entry, not a union product (dh_union=False);
- nst (with --union-down-step): as mma, with the forward's down step a union product where mma
  runs it with the weight stationary (down_stationary=False; the row's ``down_stationary``
  says what mma ran);
- ndx (with --union-dx-step): as mma, with dx a union product where mma runs it by the
  stationary walk (dx_stationary=False; the row's ``dx_stationary``);
- forward only, for dense and cuda.
Each row also records the measured active fraction and the mean 64-token union of active
neurons (``measured_union_fraction``, what the union products read). Memory held between
forward and backward: the residuals of jax.vjp (bytes of the saved arrays other than the
inputs, each left out once) for dense and cuda, and the compiled forward's
memory_analysis (output bytes, which hold the residuals).

Usage: python benchmarks/bench_training.py [--quick] [--densities 0.0025,0.005] [--cudacore-dx] [--union-dx] [--union-down] [--union-up]
       [--per-entry-dh] [--union-down-step] [--union-dx-step] [--patterns uniform,skewed] [--tokens 4096,16384]
       [--grad-only] [--out results.json]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell.formats import relu_matmul
from jax_twell.ops import blocked_emulation as bemu
from jax_twell.ops import cuda, cuda_train, xla
from jax_twell.testing import synthetic_ffn_inputs

from common import run_metadata, time_calls, time_interleaved, write_result

L1 = 2e-5
ALWAYS_SPARSE = cuda_train.TrainCrossover(margin=float("inf"))
WIDTH = 128
# Optional step variants: (argument, name, ffn_with_aux options on top of mma=True, label).
OPTIONAL_VARIANTS = (
    ("cudacore_dx", "cdx", dict(dx_mma=False), "cuda-core dx"),
    ("union_dx", "udx", dict(dx_union=True), "union dx"),
    ("union_down", "udn", dict(down_union=True), "union down"),
    ("union_up", "uup", dict(up_union=True), "union up"),
    ("per_entry_dh", "pdh", dict(dh_union=False), "per-entry dh"),
    ("union_down_step", "nst", dict(down_stationary=False), "union down step"),
    ("union_dx_step", "ndx", dict(dx_stationary=False), "union dx step"),
)


def timed(fn, args):
    return time_calls(fn, args, min_seconds=0.05, max_reps=100)


PATTERNS = ("uniform", "heavy", "skewed")


def grid(quick: bool, densities: list[float] | None = None, patterns: tuple[str, ...] | None = None,
         tokens: tuple[int, ...] = (16384,)):
    if densities is None:
        densities = [0.005, 0.02] if quick else [0.0025, 0.005, 0.01, 0.02, 0.05]
    if patterns is None:
        # "skewed" (per-neuron rates as in a trained model; jax_twell.testing) where the
        # kernels are meant to run: at most 1% active
        pick = lambda p: ("uniform", "heavy") + (("skewed",) if p <= 0.01 else ())
    else:
        pick = lambda p: patterns
    return [(m, 2048, 5632, p, pattern) for m in tokens for p in densities for pattern in pick(p)]


def step(op, grad_only: bool = False):
    """jit(value_and_grad) of sum(y * cot) + L1 * l1 with respect to x and the weights
    (``grad_only``: jit(grad), the loss's value not returned)."""

    def loss(x, wg, wu, wd, cot):
        y, l1 = op(x, wg, wu, wd)[:2]
        return (y.astype(jnp.float32) * cot).sum() + L1 * l1

    return jax.jit((jax.grad if grad_only else jax.value_and_grad)(loss, (0, 1, 2, 3)))


def forward(op):
    return jax.jit(lambda x, wg, wu, wd: op(x, wg, wu, wd)[:2])


def residual_bytes(op, args) -> int:
    """Bytes jax.vjp keeps for the backward, the operands themselves left out: one leaf per
    operand of the same shape and dtype (the operands are kept once each), so a residual
    shaped like an operand (a weight's copy, say) still counts."""
    _, vjp_fn = jax.eval_shape(lambda *a: jax.vjp(lambda *b: op(*b)[:2], *a), *args)
    operands = collections.Counter((tuple(a.shape), jnp.dtype(a.dtype)) for a in args)
    total = 0
    for leaf in jax.tree.leaves(vjp_fn):
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype))
        if operands[key] > 0:
            operands[key] -= 1
            continue
        total += int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total


def compiled_forward_output_bytes(op, args) -> int | None:
    try:
        lowered = jax.jit(lambda *a: jax.vjp(lambda *b: op(*b)[:2], *a)).lower(*args)
        return int(lowered.compile().memory_analysis().output_size_in_bytes)
    except Exception as e:  # memory_analysis is best effort across jax versions
        print("memory_analysis unavailable:", e)
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--densities", default=None, help="comma-separated active fractions (default: the grid's)")
    parser.add_argument("--cudacore-dx", action="store_true", help="also time the tensor-core steps with dx on CUDA cores")
    parser.add_argument("--union-dx", action="store_true", help="also time the tensor-core steps with dx as a union product")
    parser.add_argument("--union-down", action="store_true",
                        help="also time the tensor-core steps with the forward's down step as a union product")
    parser.add_argument("--union-up", action="store_true",
                        help="also time the tensor-core steps with the forward's up step as a union product")
    parser.add_argument("--per-entry-dh", action="store_true",
                        help="also time the tensor-core steps with the backward's dh step per entry (not a union product)")
    parser.add_argument("--union-down-step", action="store_true",
                        help="also time the tensor-core steps with the forward's down step a union product, not stationary")
    parser.add_argument("--union-dx-step", action="store_true",
                        help="also time the tensor-core steps with dx a union product, not the stationary walk")
    parser.add_argument("--patterns", default=None,
                        help=f"comma-separated activity patterns of {PATTERNS} (default: skewed only up to 1%%)")
    parser.add_argument("--tokens", default="16384", help="comma-separated token counts M (default 16384)")
    parser.add_argument("--grad-only", action="store_true",
                        help="time jax.grad alone (XLA's dense step then skips its forward down matmul), not value_and_grad")
    parser.add_argument("--no-fused-gate", action="store_true",
                        help="pack the gate with XLA's matmul + the pack kernel everywhere (the A/B of the fused gate kernel)")
    args = parser.parse_args()
    if args.no_fused_gate:
        cuda.FUSED_GATE_MIN_TOKENS = 1 << 62
    densities = [float(v) for v in args.densities.split(",")] if args.densities else None
    patterns = tuple(args.patterns.split(",")) if args.patterns else None
    if patterns is not None and not set(patterns) <= set(PATTERNS):
        parser.error(f"--patterns: each of {PATTERNS}, got {args.patterns}")

    dense_op = xla.ffn_with_aux
    cuda_op = lambda x, wg, wu, wd: cuda_train.ffn_with_aux(
        x, wg, wu, wd, width=WIDTH, crossover=ALWAYS_SPARSE, mma=False
    )
    auto_op = lambda x, wg, wu, wd: cuda_train.ffn_with_aux(x, wg, wu, wd, width=WIDTH)
    mma_op = lambda x, wg, wu, wd: cuda_train.ffn_with_aux(x, wg, wu, wd, width=WIDTH, crossover=ALWAYS_SPARSE, mma=True)
    optional = [
        (name, functools.partial(cuda_train.ffn_with_aux, width=WIDTH, crossover=ALWAYS_SPARSE, mma=True, **options))
        for flag, name, options, _ in OPTIONAL_VARIANTS
        if getattr(args, flag)
    ]
    rows, memory = [], None
    for m, d, f, density, pattern in grid(args.quick, densities, patterns, tuple(int(v) for v in args.tokens.split(","))):
        inp = synthetic_ffn_inputs(jax.random.key(m + f + int(density * 1e4)), m, d, f, density=density, pattern=pattern)
        cot = jax.random.normal(jax.random.key(1), (m, d), jnp.float32)
        act = cuda.gate_twell(inp.x, inp.w_gate, tile=cuda_train.TILE, capacity=cuda_train.CAPACITY)
        counts = np.asarray(act.counts)
        nnz = counts.sum(-1)
        need = bemu.needed_entries(counts, cuda_train.CAPACITY, cuda_train.TILE, f)
        budget = cuda_train.max_entries_for(m, f, WIDTH)
        row = dict(
            m=m, d=d, f=f, density=density, pattern=pattern,
            down_stationary=bool(cuda_train.DOWN_STATIONARY_DEFAULT and cuda.dense_crossover().down_stationary(
                m, d, f, inp.x.dtype.itemsize)),
            dx_stationary=bool(cuda_train.DX_STATIONARY_DEFAULT and cuda.dense_crossover().down_stationary(
                m, d, f, inp.x.dtype.itemsize) and cuda_train.stationary_dx_supported(
                m, d, f, cuda_train.max_entries_for(m, f, WIDTH), True)),
            measured_active_fraction=float(nnz.mean() / f),
            # the mean union of active neurons over 64-token blocks, as a fraction of f:
            # what the union products read (to fit a rule that sees it)
            measured_union_fraction=float(cuda.block_union_fraction(relu_matmul(inp.x, inp.w_gate))),
            max_active_per_row=int(nnz.max()),
            overflowed_tiles=int((counts > cuda_train.CAPACITY).sum()),
            entries_needed=int(need), entry_budget=int(budget),
            branch="sparse" if need <= budget else "dense (over the entry budget)",
            auto_rule_sparse=bool(need <= budget and cuda_train.train_crossover().use_sparse(
                int(nnz.sum()), int((counts > cuda_train.CAPACITY).sum()), m, d, f, 2)),
        )
        operands = (*inp, cot)
        fraction, union = row["measured_active_fraction"], row["measured_union_fraction"]
        layer_op = lambda x, wg, wu, wd, p=fraction, u=union: cuda_train.ffn_with_aux(
            x, wg, wu, wd, width=WIDTH, active_fraction=p, union_fraction=u
        )
        row["layer_rule_sparse"] = cuda_train.train_crossover().prefers_sparse(m, d, f, 2, fraction, union)
        variants = [("dense", dense_op), ("cuda", cuda_op), ("auto", auto_op), ("layer", layer_op), ("mma", mma_op)]
        variants += optional
        steps = time_interleaved({name: step(op, args.grad_only) for name, op in variants}, operands,
                                 min_seconds=0.05, max_reps=100)
        for name, (seconds, spread) in steps.items():
            row[f"{name}_step_ms"] = 1e3 * seconds
            row[f"{name}_step_spread"] = spread
        for name, _ in optional:
            row[f"{name}_ratio"] = row["dense_step_ms"] / row[f"{name}_step_ms"]
        for name, op in (("dense", dense_op), ("cuda", cuda_op), ("mma", mma_op)):
            row[f"{name}_forward_ms"] = 1e3 * timed(forward(op), tuple(inp))
        row["cuda_ratio"] = row["dense_step_ms"] / row["cuda_step_ms"]
        row["mma_ratio"] = row["dense_step_ms"] / row["mma_step_ms"]
        row["auto_ratio"] = row["dense_step_ms"] / row["auto_step_ms"]
        row["layer_ratio"] = row["dense_step_ms"] / row["layer_step_ms"]
        if memory is None and density == 0.005 and m == 16384:
            memory = dict(
                m=m, d=d, f=f,
                dense_residual_bytes=residual_bytes(dense_op, tuple(inp)),
                cuda_residual_bytes=residual_bytes(cuda_op, tuple(inp)),
                # the tensor-core path the rule runs: the same residuals, and the stationary
                # down walk's token order where the forward ran it
                mma_residual_bytes=residual_bytes(mma_op, tuple(inp)),
                dense_forward_output_bytes=compiled_forward_output_bytes(dense_op, tuple(inp)),
                cuda_forward_output_bytes=compiled_forward_output_bytes(cuda_op, tuple(inp)),
            )
            print(json.dumps(memory), flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)

    result = dict(
        **run_metadata("training_ffn"),
        fused_gate=not args.no_fused_gate,
        step="grad" if args.grad_only else "value_and_grad",
        dtype="bfloat16",
        tile=cuda_train.TILE,
        capacity=cuda_train.CAPACITY,
        width=WIDTH,
        l1_coefficient=L1,
        crossover=vars(cuda_train.train_crossover()),
        memory=memory,
        results=rows,
    )
    write_result(result, args.out, "training")
    print(f"\n{result['gpu']} jax {result['jax']} commit {result['commit']}")
    if memory:
        mb = {k: (round(v / 2**20, 1) if isinstance(v, int) and k.endswith("bytes") else v) for k, v in memory.items()}
        print("memory between forward and backward (MiB):", mb)
    print(f"{'M':>6} {'dens':>6} {'pattern':>8} {'act%':>6} {'max':>5} {'branch':>7} {'dense ms':>9} {'cuda ms':>8} {'ratio':>6} "
          f"{'auto ms':>8} {'auto r':>6} {'layer r':>7} {'mma ms':>8} {'mma r':>6} {'fwd dense':>9} {'fwd cuda':>8} {'fwd mma':>8}")
    for r in rows:
        print(
            f"{r['m']:>6} {r['density']:>6.3f} {r['pattern']:>8} {100 * r['measured_active_fraction']:>6.2f} {r['max_active_per_row']:>5} "
            f"{r['branch'][:6]:>7} {r['dense_step_ms']:>9.3f} {r['cuda_step_ms']:>8.3f} {r['cuda_ratio']:>6.2f} "
            f"{r['auto_step_ms']:>8.3f} {r['auto_ratio']:>6.2f} {r['layer_ratio']:>7.2f} {r['mma_step_ms']:>8.3f} {r['mma_ratio']:>6.2f} "
            f"{r['dense_forward_ms']:>9.3f} {r['cuda_forward_ms']:>8.3f} {r['mma_forward_ms']:>8.3f}"
            + "".join(f" {label} {r[name + '_step_ms']:.3f} ms ({r[name + '_ratio']:.2f}x)"
                      for _, name, _, label in OPTIONAL_VARIANTS if name + "_step_ms" in r)
        )


if __name__ == "__main__":
    main()
