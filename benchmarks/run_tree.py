"""Runs a script of another checkout of this repository, with that checkout's own package.

For A/B runs of two commits on one machine, in one device session: the baseline's kernels
cannot be timed by the current package (each library is checked against the package's
handler ABI), so the baseline runs from its own tree, with its own library:

    git archive <base> | tar -x -C /tmp/base       # here, then carried to the GPU machine
    JAX_TWELL_CUDA_LIB=/path/to/base.so \\
        python3 benchmarks/run_tree.py /tmp/base benchmarks/bench_training.py --out base.json

An editable install of the current tree puts an import hook ahead of ``sys.path`` (and of
``PYTHONPATH``), so setting the path alone would still import the current package: this
script drops that hook, puts the other tree (and its script's folder, for ``common``) first
on the path, and runs the script as ``__main__``. It prints which package it imported.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: run_tree.py TREE SCRIPT [ARGS...] (SCRIPT relative to TREE or absolute)")
    tree = os.path.abspath(argv[0])
    if not os.path.isfile(os.path.join(tree, "jax_twell", "__init__.py")):
        raise SystemExit(f"{tree} holds no jax_twell package: pass the root of a checkout")
    script = argv[1] if os.path.isabs(argv[1]) else os.path.join(tree, argv[1])
    if not os.path.isfile(script):
        raise SystemExit(f"no script {script}")
    # the editable install's finder (scikit-build-core names its module _editable_*)
    sys.meta_path[:] = [m for m in sys.meta_path if not type(m).__module__.startswith("_editable")]
    for name in [n for n in sys.modules if n == "jax_twell" or n.startswith("jax_twell.")]:
        del sys.modules[name]
    sys.path[:0] = [tree, os.path.dirname(script)]
    import jax_twell

    if os.path.dirname(os.path.abspath(jax_twell.__file__)) != os.path.join(tree, "jax_twell"):
        raise SystemExit(f"imported {jax_twell.__file__}, not the package of {tree}")
    print(f"run_tree: jax_twell from {tree}", flush=True)
    sys.argv = [script] + argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
