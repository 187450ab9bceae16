"""The training op's backed-up rows emptied inside each sparse branch, against before the
choice (main), in one process.

"main" is the op as it stands: the layout's rows past the hybrid width are emptied before
the per-call choice, at the largest backup size (three scatters that the dense side pays
too). "in_branch" is the branch ``issue-43-scatter-in-branch``'s op (its ``vjp.py``, kept
beside this script as ``scatter_in_branch_vjp.py.txt`` and loaded as a second module): each
sparse branch empties its own size's rows, the dense side none. XLA's dense step beside
them, interleaved in rounds (``common.time_interleaved``).

Usage: python lab/scatter_ab.py [--m 16384] [--family tail] [--density 0.005] [--out r.json]
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from step_variants import compiled_step, parser, patched, run, step_args

from jax_twell.ops.ffn_train import vjp

_HERE = os.path.dirname(os.path.abspath(__file__))


def branch_module():
    path = os.path.join(_HERE, "scatter_in_branch_vjp.py.txt")
    loader = importlib.machinery.SourceFileLoader("jax_twell.ops.ffn_train.vjp_in_branch", path)
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclasses look their module up
    loader.exec_module(module)
    return module


def main() -> None:
    ap = parser(__doc__, family="tail", rounds=9)
    a = ap.parse_args()
    args = step_args(a)
    other = branch_module()
    variants = {"xla": lambda: compiled_step("xla", args),
                "main": lambda: compiled_step(None, args),
                "in_branch": lambda: compiled_step(None, args, patched(vjp, _train_ffn=other._train_ffn))}
    run("scatter_ab", a, variants, args)


if __name__ == "__main__":
    main()
