"""The training backup's gathered gate and fused adds, each on and off, in one process.

"new" is the op as it stands: the forward takes the backed-up rows' gate from the call's g
(a gather) instead of a product over the rows, and the backward forms the backup's
``dw_gate`` and ``dw_up`` products as ``[f, d]``, adds them to the kernel's ``[f, d]``
results and transposes once. "prev" patches both back to the form before (the gate
recomputed; the kernel's results transposed, then the products added: two passes more a
weight); "gather_only" and "adds_only" keep one of the two. XLA's dense step beside them,
interleaved in rounds (``common.time_interleaved``).

Usage: python lab/backup_fuse_ab.py [--m 16384] [--family tail] [--out r.json]
"""

from __future__ import annotations

from step_variants import compiled_step, parser, patched, run, step_args

from jax_twell.ops import xla

_forward, _vjp = xla.backup_forward, xla.backup_vjp


def forward_recomputed(x, w_gate, w_up, w_down, *, m, g=None):
    return _forward(x, w_gate, w_up, w_down, m=m)


def vjp_transposed_first(x, w_gate, w_up, w_down, dy, dl1, *, m, grads, transposed=False):
    if transposed:
        dw_gate, dw_up, dw_down = grads
        grads = (None if dw_gate is None else dw_gate.T, dw_up.T, dw_down)
    return _vjp(x, w_gate, w_up, w_down, dy, dl1, m=m, grads=grads)


def main() -> None:
    a = parser(__doc__, family="tail", rounds=9).parse_args()
    args = step_args(a)
    old_fwd = lambda: patched(xla, backup_forward=forward_recomputed)
    old_bwd = lambda: patched(xla, backup_vjp=vjp_transposed_first)
    variants = {"xla": lambda: compiled_step("xla", args),
                "prev": lambda: compiled_step(None, args, old_fwd(), old_bwd()),
                "gather_only": lambda: compiled_step(None, args, old_bwd()),
                "adds_only": lambda: compiled_step(None, args, old_fwd()),
                "new": lambda: compiled_step(None, args)}
    run("backup_fuse_ab", a, variants, args)


if __name__ == "__main__":
    main()
