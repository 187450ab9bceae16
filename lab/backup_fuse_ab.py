"""The training backup's gathered gate, fused adds and kept rows, on and off, in one process.

"new" is the op as it stands: the forward takes the backed-up rows' gate from the call's g
(a gather) instead of a product over the rows and keeps their g and u for the backward
(up to M/32 rows), and the backward forms the backup's ``dw_gate`` and ``dw_up`` products
as ``[f, d]``, adds them to the kernel's ``[f, d]`` results and transposes once. "prev"
patches all three back to the form before (the gate recomputed in both directions; the
kernel's results transposed, then the products added: two passes more a weight);
"gather_only" and "adds_only" keep one of the first two, "no_keep" both of them but not
the kept rows; "keep16" keeps the rows up to M/16 instead of M/32. XLA's dense step beside
them, interleaved in rounds (``common.time_interleaved``).

Usage: python lab/backup_fuse_ab.py [--m 16384] [--family tail] [--variants prev,new] [--out r.json]
"""

from __future__ import annotations

from step_variants import compiled_step, parser, patched, run, step_args

from jax_twell.ops import layout, xla

_forward, _vjp, _kept_rows = xla.backup_forward, xla.backup_vjp, layout.train_backup_kept_rows


def forward_recomputed(x, w_gate, w_up, w_down, *, m, g=None, hidden=False):
    return _forward(x, w_gate, w_up, w_down, m=m, hidden=hidden)


def vjp_transposed_first(x, w_gate, w_up, w_down, dy, dl1, *, m, grads, transposed=False, hidden=None):
    if transposed:
        dw_gate, dw_up, dw_down = grads
        grads = (None if dw_gate is None else dw_gate.T, dw_up.T, dw_down)
    return _vjp(x, w_gate, w_up, w_down, dy, dl1, m=m, grads=grads, hidden=hidden)


def kept_to_m16(m, capacity=None):
    return _kept_rows(m, capacity, share=16)


def main() -> None:
    ap = parser(__doc__, family="tail", rounds=9)
    ap.add_argument("--variants", default="prev,gather_only,adds_only,no_keep,new")
    a = ap.parse_args()
    args = step_args(a)
    old_fwd = lambda: patched(xla, backup_forward=forward_recomputed)
    old_bwd = lambda: patched(xla, backup_vjp=vjp_transposed_first)
    no_keep = lambda: patched(layout, train_backup_kept_rows=lambda m, capacity=None: 0)
    variants = {"xla": lambda: compiled_step("xla", args),
                "prev": lambda: compiled_step(None, args, old_fwd(), old_bwd(), no_keep()),
                "gather_only": lambda: compiled_step(None, args, old_bwd(), no_keep()),
                "adds_only": lambda: compiled_step(None, args, old_fwd(), no_keep()),
                "no_keep": lambda: compiled_step(None, args, no_keep()),
                "new": lambda: compiled_step(None, args),
                "keep16": lambda: compiled_step(None, args, patched(layout, train_backup_kept_rows=kept_to_m16))}
    chosen = {k: variants[k] for k in ["xla", *a.variants.split(",")]}
    run("backup_fuse_ab", a, chosen, args)


if __name__ == "__main__":
    main()
