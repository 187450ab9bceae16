"""A/B of the CPU inference path: an earlier ``jax_twell/ops/ffn/cpu.py`` (a file, e.g. from
``git show REV:jax_twell/ops/ffn/cpu.py``) against the installed one, XLA's dense FFN (twice:
the spread of one program) beside them, interleaved in one process on the same operands.

    python lab/cpu_dense_side_ab.py OLD_CPU_PY OUT.json M:d:f:density:dtype ...
"""
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_patterns import family_inputs  # noqa: E402
from common import run_metadata, time_interleaved  # noqa: E402

from jax_twell.ops import xla  # noqa: E402
from jax_twell.ops.ffn import cpu as new  # noqa: E402


def main(argv):
    old_path, out = argv[0], argv[1]
    spec = importlib.util.spec_from_file_location("cpu_old", old_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    result = dict(run_metadata("cpu_dense_side_ab"), old=old_path, rows=[])
    for cfg in argv[2:]:
        m, d, f, p, dt = cfg.split(":")
        m, d, f, p = int(m), int(d), int(f), float(p)
        x, wg, wu, wd = (a.astype(jnp.dtype(dt)) for a in family_inputs(jax.random.key(m + d), m, d, f, p, "uniform"))
        fns = dict(xla=xla.ffn, xla2=lambda *a: xla.ffn(*a), old=old.sparse_ffn, new=new.sparse_ffn)
        fns = {k: jax.jit(v) for k, v in fns.items()}
        t = time_interleaved(fns, (x, wg, wu, wd), min_seconds=0.15, max_reps=2000, rounds=11)
        ratio = {k: t["xla"][0] / v[0] for k, v in t.items()}
        result["rows"].append(dict(config=cfg, ms={k: v[0] * 1e3 for k, v in t.items()},
                                   spread={k: v[1] for k, v in t.items()}, vs_xla=ratio))
        print(f"{cfg:28s} " + "  ".join(f"{k} {v[0] * 1e3:8.3f} ms ({ratio[k]:.3f}x)" for k, v in t.items()), flush=True)
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
