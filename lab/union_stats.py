"""How large a token block's union of active neurons is on a trained model's activations.

The union products (``kernel="blocked_union"``, the training forward's up and down steps
and dx; ffi/notes/twell_ffn_blocked.md) read the weight rows of every neuron active for
some token of a 64-token block, so their cost follows the block's *union*, not the number
of active pairs. The synthetic benchmark patterns draw each token's neurons uniformly
(union ``1 - (1 - p)^64`` of f at density p: 27% at 0.5%). This script measures the union
on real activations: it restores a training run's checkpoint, runs its held-out tokens
through the model on the CPU or GPU (plain JAX, eagerly), records each sparse FFN layer's
activation mask, and reports per layer and block size the mean union fraction against the
uniform model's at the same density.

Usage:
  python lab/union_stats.py --workdir runs/tiny [--tokens 16384] [--out stats.json]

The union depends on the order of the tokens within a block: blocks here are consecutive
positions of held-out sequences, as a serving batch of prompts or a training batch holds
them (``--shuffle`` measures randomly ordered tokens instead).
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_twell.modules import SparseFFN

BLOCKS = (16, 64, 128, 1024)


def capture_masks(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Each sparse FFN layer's ``[n_tokens, f]`` bool activation mask (``g > 0``) for
    ``tokens [B, T]``, in layer order."""
    masks: list[np.ndarray] = []
    original = SparseFFN.forward_with_stats

    def recording(self, x):
        w_gate, w_up, _ = self._weights(x.dtype)
        act = (w_gate if self.gated else w_up).astype(x.dtype)
        g = jnp.einsum("...d,df->...f", x, act, preferred_element_type=jnp.float32)
        masks.append(np.asarray(g > 0).reshape(-1, g.shape[-1]))
        return original(self, x)

    SparseFFN.forward_with_stats = recording
    try:
        model(jnp.asarray(tokens, jnp.int32))
    finally:
        SparseFFN.forward_with_stats = original
    return masks


def union_stats(mask: np.ndarray, block: int) -> dict:
    """Mean union fraction over the full ``block``-token blocks of ``mask [n, f]``, the
    uniform model's at the mask's density, and the density itself."""
    n, f = mask.shape
    n_blocks = n // block
    if n_blocks == 0:
        raise ValueError(f"{n} tokens: fewer than one block of {block}")
    blocks = mask[: n_blocks * block].reshape(n_blocks, block, f)
    union = blocks.any(axis=1).mean()
    density = mask.mean()
    uniform = 1.0 - (1.0 - density) ** block
    return dict(block=block, union=float(union), uniform_union=float(uniform),
                ratio=float(union / uniform) if uniform > 0 else math.nan)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="a training run's directory (config and checkpoints)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to run (whole sequences)")
    p.add_argument("--shuffle", action="store_true", help="shuffle the tokens across blocks before the union")
    p.add_argument("--out", default=None, help="write the statistics as JSON here")
    a = p.parse_args()

    from jax_twell.train import data, sharding, trainer

    cfg = trainer.load_run_config(a.workdir)
    setup, state = trainer.restore_run(cfg, a.step, shard_tokens=False)
    model = setup.bind(state.params)
    corpus = data.load_corpus(cfg.data, cfg.workdir, cfg.model.vocab_size, save_tokenizer=False)
    seq = trainer.seq_len_of(cfg)
    n_seq = max(1, a.tokens // seq)
    if corpus.eval.size < n_seq * seq:
        n_seq = corpus.eval.size // seq
        if n_seq == 0:
            raise SystemExit(f"the held-out split has fewer than {seq} tokens")
    tokens = np.asarray(corpus.eval[: n_seq * seq], np.int64).reshape(n_seq, seq)
    with sharding.mesh_context(setup.mesh):
        masks = capture_masks(model, tokens)
    if not masks:
        raise SystemExit("the model has no sparse FFN layer")
    rng = np.random.default_rng(0)
    layers = []
    print(f"{cfg.workdir}: step {int(state.step)}, {tokens.size} held-out tokens, f={masks[0].shape[1]}"
          + (", tokens shuffled" if a.shuffle else ""))
    print(f"{'layer':>5} {'active':>8} {'dead':>6}" + "".join(f"  union{b:<5} unif{b:<6}" for b in BLOCKS))
    for i, mask in enumerate(masks):
        if a.shuffle:
            mask = mask[rng.permutation(mask.shape[0])]
        row = dict(layer=i, density=float(mask.mean()), dead=float((~mask.any(axis=0)).mean()),
                   blocks=[union_stats(mask, b) for b in BLOCKS if mask.shape[0] >= b])
        layers.append(row)
        cells = "".join(f"  {s['union']:>9.1%} {s['uniform_union']:>9.1%}" for s in row["blocks"])
        print(f"{i:>5} {row['density']:>8.2%} {row['dead']:>6.1%}{cells}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(dict(workdir=str(cfg.workdir), step=int(state.step), tokens=int(tokens.size),
                           shuffled=a.shuffle, jax=jax.__version__, layers=layers), fh, indent=1)


if __name__ == "__main__":
    main()
