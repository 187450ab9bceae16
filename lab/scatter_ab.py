"""The training op's backed-up rows emptied inside each sparse branch, against before the
choice (main), in one process.

"main" is the op as it stands: the layout's rows past the hybrid width are emptied before
the per-call choice, at the largest backup size (three scatters that the dense side pays
too). "in_branch" is the branch ``issue-43-scatter-in-branch``'s op: main's ``vjp.py`` with
the branch's diff (``scatter_in_branch.diff`` beside this script) applied to its text and
loaded as a second module; each sparse branch empties its own size's rows, the dense side
none. XLA's dense step beside
them, interleaved in rounds (``common.time_interleaved``).

Usage: python lab/scatter_ab.py [--m 16384] [--family tail] [--density 0.005] [--out r.json]
"""

from __future__ import annotations

import os
import sys
import types

from step_variants import compiled_step, parser, patched, run, step_args

from jax_twell.ops.ffn_train import vjp

_HERE = os.path.dirname(os.path.abspath(__file__))


def patched_source(source: str, diff: str) -> str:
    """``source`` with each hunk of the unified ``diff`` applied (its context and removed
    lines replaced by its context and added lines; each must occur once)."""
    hunks, old, new = [], None, None
    for line in diff.splitlines():
        if line.startswith("@@"):
            if old is not None:
                hunks.append((old, new))
            old, new = [], []
        elif old is not None and not line.startswith(("---", "+++")):
            tag, text = line[:1], line[1:]
            if tag in (" ", "-"):
                old.append(text)
            if tag in (" ", "+"):
                new.append(text)
    if old is not None:
        hunks.append((old, new))
    for old, new in hunks:
        block = "\n".join(old) + "\n"
        if source.count(block) != 1:
            raise SystemExit("scatter_in_branch.diff does not apply to this tree's vjp.py")
        source = source.replace(block, "\n".join(new) + "\n")
    return source


def branch_module():
    with open(vjp.__file__) as fh, open(os.path.join(_HERE, "scatter_in_branch.diff")) as dh:
        source = patched_source(fh.read(), dh.read())
    name = "jax_twell.ops.ffn_train.vjp_in_branch"
    module = types.ModuleType(name)
    module.__file__ = vjp.__file__
    sys.modules[name] = module  # its dataclasses look their module up
    exec(compile(source, f"{vjp.__file__} (in_branch)", "exec"), module.__dict__)
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
