"""What the training step's conditionals cost: the default step against the same step with
each ``lax.switch`` of the training op replaced, at trace time, by the branch these rows
take (no host read of the index; exact only for rows that take that branch, checked here
against XLA's step), XLA's dense step beside them in the same rounds.

Usage: python lab/sync_probe.py [--m 16384] [--family uniform] [--branch 1] [--out r.json]

``--branch``: the switch index the rows take: 1 is the sparse side with no backed-up rows,
1 + i the sparse side with the i-th size of ``layout.train_backup_buckets`` (the tail
family's 328 rows at M=16,384 take i = 2, 512 rows). Run it again with XLA_FLAGS set to see
what XLA's own options change (the JSON records the flags).
"""

from __future__ import annotations

import jax

from step_variants import compiled_step, parser, patched, run, step_args


def main() -> None:
    ap = parser(__doc__, family="uniform", rounds=9)
    ap.add_argument("--branch", type=int, default=1)
    a = ap.parse_args()
    args = step_args(a)
    fixed = lambda: patched(jax.lax, switch=lambda _, branches, *ops: branches[a.branch](*ops))
    run("sync_probe", a, {"xla": lambda: compiled_step("xla", args), "default": lambda: compiled_step(None, args),
                          "fixed_branch": lambda: compiled_step(None, args, fixed())}, args, branch=a.branch)


if __name__ == "__main__":
    main()
