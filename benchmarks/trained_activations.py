"""A trained model's FFN inputs and weights, written as benchmark inputs.

Restores a run written by ``jax-twell train`` (its newest checkpoint, or ``--step``),
runs the training forward on ``--tokens`` held-out tokens (the run's evaluation split,
windows of the run's sequence length spread evenly over it, as ``jax-twell eval`` takes
them) and keeps, for the first, middle (``n_layers // 2``) and last layer, the input its
FFN receives: the normalised hidden state ``x [M, d]``. Each layer gives one file
``trained_<preset>_L<layer>_m<M>.npz`` in ``--out-dir``, in the format of
``bench_patterns.py --npz-dir`` (x, w_gate, w_up, w_down as bf16 bits; weights rounded to
bf16 from the stored parameters), and one JSON summary ``trained_<preset>_m<M>.json``
gives per layer the activity of those bf16 operands: density (mean fraction of
``relu(x @ w_gate) > 0``), percentiles of the active neurons per token, the fraction of
tokens above 10% of f, and the checkpoint's step.

  jax-twell train --preset small                     (writes runs/small)
  python3 benchmarks/trained_activations.py --workdir runs/small --out-dir trained [--tokens 16384] [--step N]
  python3 benchmarks/bench_patterns.py --npz trained/*.npz --out patterns_trained.json

The forward runs with the run's own model configuration on whatever devices JAX finds,
tokens kept whole (not split over devices), ``--batch`` sequences a call. The published
inference kernels take d = 2048 and token counts that are multiples of 256 only; the
``small`` preset's d is 512.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import run_metadata, save_npz  # noqa: E402

from jax_twell.train import data, sharding, trainer  # noqa: E402
from jax_twell.train.config import seq_len_of  # noqa: E402


def capture_layers(n_layers: int) -> list[int]:
    """The layers captured: first, middle (``n_layers // 2``) and last, without repeats."""
    return sorted({0, n_layers // 2, n_layers - 1})


def heldout_tokens(eval_tokens: np.ndarray, m: int, seq_len: int) -> np.ndarray:
    """``ceil(m / seq_len)`` windows of ``seq_len`` tokens spread evenly over the held-out
    split ``eval_tokens`` (``data.eval_batch``): ``[sequences, seq_len]`` int32."""
    sequences = -(-m // seq_len)
    batch = data.eval_batch(eval_tokens, 0, num_batches=1, batch_size=sequences, seq_len=seq_len)
    return batch[:, :-1]


def ffn_inputs(setup, params, tokens: np.ndarray, layers: list[int], batch: int) -> list[np.ndarray]:
    """The FFN inputs of ``layers`` for ``tokens [S, T]``, through the model of ``setup``
    with ``params`` (``TransformerLM.ffn_inputs``), ``batch`` sequences a call: one
    ``[S * T, d]`` bf16 array per layer (token rows in sequence order)."""
    fn = jax.jit(lambda p, t: [h.astype(jnp.bfloat16) for h in setup.bind(p).ffn_inputs(t, layers)])
    parts = [[] for _ in layers]
    with sharding.mesh_context(setup.mesh):
        for start in range(0, len(tokens), batch):
            for out, h in zip(parts, jax.device_get(fn(params, jnp.asarray(tokens[start : start + batch])))):
                out.append(np.asarray(h).reshape(-1, h.shape[-1]))
    return [np.concatenate(p) for p in parts]


def ffn_weights(setup, params, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(w_gate, w_up, w_down)`` of ``layer``, rounded to bf16 (host arrays)."""
    with sharding.mesh_context(setup.mesh):
        ffn = setup.bind(params).layers[layer].ffn
        if ffn.w_gate is None:
            raise ValueError("the model's FFN is not gated: the benchmark's inputs need w_gate")
        weights = (ffn.w_gate, ffn.w_up, ffn.w_down)
        return tuple(np.asarray(jax.device_get(w[...].astype(jnp.bfloat16))) for w in weights)


def activity(x: np.ndarray, w_gate: np.ndarray) -> dict:
    """Activity of ``relu(x @ w_gate)`` for bf16 ``x [M, d]``, ``w_gate [d, f]`` (products
    in f32): density (mean active fraction), percentiles p50/p90/p99 and max of the active
    neurons per token row, and the fraction of rows with more than 10% of f active."""
    f = w_gate.shape[1]
    counts = (x.astype(np.float32) @ w_gate.astype(np.float32) > 0).sum(axis=1)
    p50, p90, p99 = (float(v) for v in np.percentile(counts, [50, 90, 99]))
    return dict(
        density=float(counts.mean() / f),
        active_p50=p50, active_p90=p90, active_p99=p99, active_max=int(counts.max()),
        rows_over_10pct_fraction=float((counts > 0.1 * f).mean()),
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="run directory written by `jax-twell train`")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step to load (default: the newest that loads)")
    ap.add_argument("--tokens", type=int, default=16384, help="held-out tokens M per layer (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence (default: the run's training sequence length)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward call (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, required=True, help="folder for the .npz files and the JSON summary")
    return ap


def main(argv: list[str] | None = None) -> dict:
    """Command line (module docstring); returns the JSON summary it writes."""
    ap = _parser()
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.batch < 1:
        ap.error("--tokens and --batch must be >= 1")
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's routine notices
    cfg = trainer.load_run_config(a.workdir)
    model = cfg.model
    if not model.gated or model.ffn == "dense_silu":
        ap.error(f"the run's FFN (ffn={model.ffn}, gated={model.gated}) has no ReLU gate weight to benchmark")
    seq_len = a.seq_len or seq_len_of(cfg)
    if not 1 <= seq_len <= model.max_seq_len:
        ap.error(f"--seq-len must be in 1..{model.max_seq_len} (the model's context), got {seq_len}")
    setup, state = trainer.restore_run(
        cfg, a.step, shard_tokens=False, report=lambda msg: print(f"note: {msg}", file=sys.stderr)
    )
    step = int(state.step)
    corpus = data.load_corpus(cfg.data, cfg.workdir, model.vocab_size, save_tokenizer=False)
    tokens = heldout_tokens(corpus.eval, a.tokens, seq_len)
    if tokens.size > len(corpus.eval):
        print(f"note: the held-out split has {len(corpus.eval):,} tokens, fewer than the {tokens.size:,} asked for "
              "(with whole sequences): the windows overlap", file=sys.stderr)
    layers = capture_layers(model.n_layers)
    xs = ffn_inputs(setup, state.params, tokens, layers, a.batch)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    summary = dict(
        run_metadata("trained_activations"),
        preset=cfg.preset, run=Path(a.workdir).name, step=step, tokens=a.tokens, seq_len=seq_len,
        sequences=len(tokens), heldout_split_tokens=int(len(corpus.eval)), n_layers=model.n_layers,
        d=model.d_model, f=model.d_ff, compute_dtype=model.dtype, param_dtype=model.param_dtype,
        l1_coef=cfg.l1_coef, layers=[],
    )
    for layer, x in zip(layers, xs):
        x = x[: a.tokens]
        w_gate, w_up, w_down = ffn_weights(setup, state.params, layer)
        name = f"trained_{cfg.preset}_L{layer}_m{a.tokens}.npz"
        save_npz(a.out_dir / name, x, w_gate, w_up, w_down)
        row = dict(layer=layer, file=name, step=step, **activity(x, w_gate))
        summary["layers"].append(row)
        print(f"layer {layer:3d}: density {row['density'] * 100:6.3f}%  active p50 {row['active_p50']:.0f} "
              f"p90 {row['active_p90']:.0f} p99 {row['active_p99']:.0f} max {row['active_max']}  "
              f"rows > 10% of f {row['rows_over_10pct_fraction'] * 100:.2f}%  -> {name}", flush=True)
    path = a.out_dir / f"trained_{cfg.preset}_m{a.tokens}.json"
    path.write_text(json.dumps(summary, indent=1))
    print("wrote", path)
    return summary


if __name__ == "__main__":
    main()
