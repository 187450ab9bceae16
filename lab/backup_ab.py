"""The training op's backup, old form against new, in one process: the default training step
traced with the backed-up rows computed as ``xla.backup_forward`` / ``xla.backup_vjp`` write
them (new), and as before 52f9760 (old: autodiff of the dense formula over the gathered rows,
the weights' sums with the kernels' gradients in f32), XLA's dense step beside them,
interleaved in rounds (``common.time_interleaved``).

Usage: python lab/backup_ab.py [--m 16384] [--family tail] [--fine] [--out r.json]

``--fine`` adds the new form with sizes at every half step between the op's (M/64, 3M/128,
M/32, 3M/64, ... M/4; "new_fine"): the tail family's 328 rows then take 384, not 512.
"""

from __future__ import annotations

import jax.numpy as jnp

from step_variants import compiled_step, parser, patched, run, step_args

from jax_twell.ops import layout, xla


def old_forward(x, w_gate, w_up, w_down, *, m):
    y, l1, _, fired = xla.ffn_with_aux(x, w_gate, w_up, w_down)
    return y, l1 * (x.shape[0] / max(m, 1)), fired


def old_vjp(x, w_gate, w_up, w_down, dy, dl1, *, m, grads):
    db = xla.ffn_with_aux_vjp(x, w_gate, w_up, w_down, dy, dl1 * (x.shape[0] / max(m, 1)))
    add = lambda a, b: None if a is None else (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
    return (db[0], *(add(a, b) for a, b in zip(grads, db[1:])))


def fine_buckets(m: int, capacity: int | None = None) -> tuple[int, ...]:
    cap = m if capacity is None else min(m, capacity)
    return tuple(sorted({min(cap, -(-(m * j // 128 or 1) // 8) * 8) for j in (2, 3, 4, 6, 8, 12, 16, 24, 32)} | {0}))


def main() -> None:
    ap = parser(__doc__, family="tail", rounds=11)
    ap.add_argument("--fine", action="store_true")
    a = ap.parse_args()
    args = step_args(a)
    variants = {"xla": lambda: compiled_step("xla", args),
                "old": lambda: compiled_step(None, args, patched(xla, backup_forward=old_forward, backup_vjp=old_vjp)),
                "new": lambda: compiled_step(None, args)}
    if a.fine:
        variants["new_fine"] = lambda: compiled_step(None, args, patched(layout, train_backup_buckets=fine_buckets))
    run("backup_ab", a, variants, args)


if __name__ == "__main__":
    main()
