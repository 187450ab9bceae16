"""A deeper model from a trained one, whose every FFN reads what its trained layer read.

Training a large shape until its FFNs are sparse takes long; its speed figures, though,
depend mostly on each layer's activation statistics (the fraction of active neurons, and
the tail of non-zeros per token that the kernels' dense backup handles). `grow_run` makes
a run of a deeper shape from a trained run's layers:

- the two shapes must agree in everything but the number of layers (the paper's presets
  0.5b, 1b, 1.5b and 2b differ only there);
- layer ``i`` of the ``L`` new layers takes the trained layer ``floor(i * L0 / L)`` of the
  ``L0`` source layers: each source layer becomes a block of consecutive copies, in order;
- the embedding, the final norm and the output head are the source's;
- the new run directory holds the config (the source's, with the new shape and preset),
  the source's tokenizer, and one checkpoint of the source's step whose per-layer training
  state follows the same map as its weights: the optimizer's moments, the dead-neuron
  counters and each layer's traced side (sparse or dense training kernels). So the run
  continues the source's schedule where it stopped, as a trained model would, and its
  training step runs each FFN on the side its trained layer ran (a fresh state would
  start every layer on the dense side and at the warm-up's learning rate). It can be
  benchmarked (`jax-twell bench --workdir`) or fine-tuned (`jax-twell train --resume`
  with a larger ``steps=``).

**Quiet copies (the default).** In a pre-norm block the stream after a layer is
``h = s + attn(norm(s))``, then ``h + ffn(norm(h))``. A block of ``k`` copies of trained
layer ``j`` is laid out so that every copy's FFN reads exactly ``norm(h_j)``, what the
trained layer's FFN read:

- the first copy keeps its attention output and makes its FFN output quiet;
- the middle copies make both outputs quiet;
- the last copy makes its attention output quiet and keeps its FFN output.

A quiet output is the trained projection (`wo`, `w_down`) scaled by ``QUIET`` = 2^-64: it
adds ~1e-20 of the stream's size, which rounds away in every addition, so the grown model
computes the source's function (the same logits and cross-entropy, up to that rounding)
and each of its FFNs has its trained layer's statistics, token by token. The projections
are scaled rather than zeroed so that the products still multiply the trained weights'
bits (a GPU draws less power on zero operands, which would flatter energy figures);
every product of the grown model costs what it costs in a trained model of its depth.
(Function-preserving expansion with zeroed output projections is how LLaMA Pro's block
expansion starts; here the copies are placed so that the FFNs' inputs are kept too.)
What a grown model does not have is a trained model's quality at its depth, nor its
attention statistics: label its figures as a grown model's.

**Full copies** (``full_copies=True``): every copy the whole trained layer (depth
up-scaling). Only the first layer then reads what its trained layer read; every later
layer reads a stream that more copies have written, and fires less, with thinner tails
(on the `small` preset grown from 8 to 28 layers: 1.4-10x below the trained layer's mean
active fraction, the largest token counts several times lower, held-out CE 2.49 against
1.97). A start for a fine-tune, not a stand-in for a trained model's statistics.

Both models' FFN statistics are measured on the same held-out tokens (per layer: the
mean fraction of active neurons, and the 50th / 99th percentile and the maximum of the
non-zeros a token), printed side by side and written to ``grow.json`` in the new run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_twell.train import config as config_lib
from jax_twell.train import data, sharding, trainer
from jax_twell.train.bench_measure import code_commit
from jax_twell.train.checkpoint import Checkpointer
from jax_twell.train.dead_neurons import gate_weight_name
from jax_twell.train.tokenizer import BPE_FILE

GROW_FILE = "grow.json"
# The scale of a quiet copy's output projection: its additions to the stream round away.
QUIET = 2.0**-64
# Held-out tokens for the statistics: at most this many sequences of the run's length.
STAT_SEQUENCES = 8


def layer_sources(source_layers: int, layers: int) -> list[int]:
    """The source layer each of ``layers`` new layers starts from: ``floor(i * L0 / L)``.

    Every source layer is used, as a block of consecutive copies (sizes differ by at most
    one), in the source's order. Raises ValueError unless ``layers >= source_layers >= 1``.
    """
    if source_layers < 1 or layers < source_layers:
        raise ValueError(f"a grown model needs at least the source's {source_layers} layers, got {layers}")
    return [i * source_layers // layers for i in range(layers)]


def grown_config(source: config_lib.TrainConfig, preset: str, overrides: list[str] = ()) -> config_lib.TrainConfig:
    """The new run's config: the source run's, with ``preset``'s model shape and name.

    Raises ValueError when the preset's model differs from the source's in anything but
    ``n_layers`` (and the implementation fields, which follow the source), or has fewer
    layers.
    """
    if preset not in config_lib.PRESETS:
        raise ValueError(f"unknown preset {preset!r} (one of {', '.join(config_lib.PRESETS)})")
    target = config_lib.PRESETS[preset].model
    shape_fields = ("vocab_size", "d_model", "n_heads", "head_dim", "d_ff", "n_kv_heads", "gated", "tie_embeddings")
    differ = [
        f"{name} ({getattr(source.model, name)} in the source, {getattr(target, name)} in {preset})"
        for name in shape_fields
        if getattr(source.model, name) != getattr(target, name)
    ]
    if differ:
        raise ValueError(f"preset {preset} differs from the source run in more than its depth: {', '.join(differ)}")
    model = dataclasses.replace(source.model, n_layers=target.n_layers, max_seq_len=target.max_seq_len)
    cfg = dataclasses.replace(source, model=model, preset=preset)
    cfg = config_lib.validate(config_lib.apply_overrides(cfg, list(overrides)))
    layer_sources(source.model.n_layers, cfg.model.n_layers)  # raises on too few layers
    return cfg


def quiet_outputs(sources: list[int]) -> list[tuple[bool, bool]]:
    """Per new layer, whether its (attention, FFN) outputs are quiet, so that every copy's
    FFN reads what its source layer's FFN read: in a block of copies the first keeps its
    attention, the last its FFN, and a block of one keeps both."""
    flags = []
    for i, s in enumerate(sources):
        first = i == 0 or sources[i - 1] != s
        last = i == len(sources) - 1 or sources[i + 1] != s
        flags.append((not first, not last))
    return flags


def grow_params(params: dict, sources: list[int], *, full_copies: bool = False) -> dict:
    """A pure params dict with ``layers[i]`` a copy of ``params["layers"][sources[i]]``;
    unless ``full_copies``, with the output projections that `quiet_outputs` names scaled
    by ``QUIET`` (attention ``wo``, FFN ``w_down``)."""
    grown = {k: v for k, v in params.items() if k != "layers"}
    grown["layers"] = {}
    for i, (s, (quiet_attn, quiet_ffn)) in enumerate(zip(sources, quiet_outputs(sources))):
        layer = jax.tree.map(jnp.copy, params["layers"][s])
        if not full_copies:
            if quiet_attn:
                layer["attn"]["wo"] = _quiet(layer["attn"]["wo"])
            if quiet_ffn:
                layer["ffn"]["w_down"] = _quiet(layer["ffn"]["w_down"])
        grown["layers"][i] = layer
    return grown


def _quiet(w: jax.Array) -> jax.Array:
    # A power of two: an exact exponent shift in f32 and bf16, whose smallest normal
    # (~1e-38) lies far below 2^-64 times any trained weight; in f16 it would underflow.
    if w.dtype == jnp.float16:
        raise ValueError("quiet copies need a parameter dtype with f32's exponent range (float32 or bfloat16), not float16")
    return (w.astype(jnp.float32) * QUIET).astype(w.dtype)


def token_nnz(model, params: dict, tokens: jax.Array) -> jax.Array:
    """``[L, B * T]`` int32: each layer's count of active FFN neurons for each token of
    ``tokens [B, T]`` in the training forward (the gate's pre-activation above zero, in
    the compute dtype). Traceable."""
    inputs = model.ffn_inputs(tokens, range(len(model.layers)))
    counts = []
    for i, h in enumerate(inputs):
        ffn = params["layers"][i]["ffn"]
        w = ffn[gate_weight_name(ffn)].astype(h.dtype)
        pre = jnp.einsum("btd,df->btf", h, w, preferred_element_type=jnp.float32)
        counts.append(jnp.sum(pre > 0, axis=-1, dtype=jnp.int32).reshape(-1))
    return jnp.stack(counts)


def layer_statistics(counts: np.ndarray, d_ff: int) -> list[dict]:
    """Per layer of ``counts [L, N]``: mean active fraction and the non-zeros a token at
    the 50th and 99th percentiles and at most."""
    return [
        {
            "active_fraction": float(c.mean() / d_ff),
            "nnz_p50": float(np.percentile(c, 50)),
            "nnz_p99": float(np.percentile(c, 99)),
            "nnz_max": int(c.max()),
        }
        for c in np.asarray(counts)
    ]


def _layer_map_path(path: tuple, sources: list[int]) -> tuple:
    """``path`` (a key path of a tree holding ``["layers"][i]``) with ``i`` replaced by
    its source layer."""
    keys = list(path)
    for k, key in enumerate(keys[:-1]):
        if isinstance(key, jax.tree_util.DictKey) and key.key == "layers":
            nxt = keys[k + 1]
            if isinstance(nxt, jax.tree_util.DictKey) and isinstance(nxt.key, int):
                keys[k + 1] = jax.tree_util.DictKey(sources[nxt.key])
    return tuple(keys)


def grow_training_state(src_state, state, sources: list[int]):
    """``state`` (the grown run's, with its grown params) given the source run's step,
    and its optimizer state, dead-neuron counters and traced sides mapped layer by layer
    as the weights are (``sources``); placed as ``state``'s leaves are sharded."""
    src_leaves = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(src_state.opt_state)}

    def mapped(path, like):
        key = jax.tree_util.keystr(_layer_map_path(path, sources))
        if key not in src_leaves:
            raise ValueError(f"the source's optimizer state has no {key} (another optimizer?)")
        value = src_leaves[key]
        if value.shape != like.shape:
            raise ValueError(f"the source's optimizer state {key} has shape {value.shape}, the grown run's {like.shape}")
        return jax.device_put(jnp.asarray(value).astype(like.dtype), like.sharding)

    opt_state = jax.tree_util.tree_map_with_path(mapped, state.opt_state)
    index = np.asarray(sources)
    since_fired = jax.device_put(jnp.asarray(np.asarray(src_state.since_fired)[index]), state.since_fired.sharding)
    ffn_sparse = jax.device_put(jnp.asarray(np.asarray(src_state.ffn_sparse)[index]), state.ffn_sparse.sharding)
    step = jax.device_put(jnp.asarray(src_state.step, state.step.dtype), state.step.sharding)
    return state._replace(step=step, opt_state=opt_state, since_fired=since_fired, ffn_sparse=ffn_sparse)


def _measure(cfg: config_lib.TrainConfig, setup, params: dict, tokens: np.ndarray) -> list[dict]:
    with sharding.mesh_context(setup.mesh):
        model = setup.bind(params)
        counts = nnx.jit(token_nnz)(model, params, jnp.asarray(tokens))
    return layer_statistics(np.asarray(counts), cfg.model.d_ff)


def run_state(cfg: config_lib.TrainConfig, params: dict, *, step: int):
    """``(ModelSetup, TrainState)`` of a new run of ``cfg`` whose parameters are ``params``
    (a pure dict of the model's structure, cast to its dtypes and placed as it shards
    them) at ``step``, with a fresh optimizer state and dead-neuron counters."""
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.mesh_context(mesh):
        setup = trainer.setup_model(cfg.model, cfg.seed, trainer.make_optimizer(cfg.optim, cfg.steps), mesh, shard_tokens=False)
        state = setup.init()
        placed = jax.tree.map(lambda new, like: jax.device_put(jnp.asarray(new).astype(like.dtype), like.sharding), params, state.params)
    return setup, state._replace(step=jnp.int32(step), params=placed)


def save_run(cfg: config_lib.TrainConfig, setup, state, *, tokenizer_from: str | Path | None = None) -> None:
    """Writes ``cfg.workdir`` as `jax-twell train` leaves a run: its config, the trained BPE
    of ``tokenizer_from`` (a run directory) when the config names "bpe", and ``state`` as
    the checkpoint of its step."""
    workdir = Path(cfg.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None and cfg.data.tokenizer == "bpe" and (Path(tokenizer_from) / BPE_FILE).exists():
        shutil.copy(Path(tokenizer_from) / BPE_FILE, workdir / BPE_FILE)
    config_lib.save(cfg, workdir / trainer.CONFIG_FILE)
    with sharding.mesh_context(setup.mesh):
        checkpointer = Checkpointer(workdir, cfg.keep_checkpoints)
        try:
            checkpointer.save(int(state.step), state)
        finally:
            checkpointer.wait()
            checkpointer.close()


def grow_run(
    source_workdir: str | Path,
    preset: str,
    workdir: str | Path,
    overrides: list[str] = (),
    *,
    step: int | None = None,
    full_copies: bool = False,
    report: Callable[[str], None] = print,
) -> dict:
    """Writes a run of ``preset``'s depth in ``workdir`` from the run in ``source_workdir``
    (its checkpoint ``step``, default the newest) and returns the report also written to
    ``workdir/grow.json``: the layer map and both models' per-layer FFN statistics on the
    same held-out tokens (``STAT_SEQUENCES`` sequences of the run's length at most).
    ``full_copies``: every layer a whole copy of its trained layer instead of the quiet
    layout (see the module's docstring).

    Raises ValueError for a preset of another shape or fewer layers, or a ``workdir`` that
    already holds files; ``checkpoint.RestoreError`` when the source has no checkpoint that
    loads.
    """
    workdir = Path(workdir)
    if workdir.exists() and any(workdir.iterdir()):
        raise ValueError(f"{workdir} is not empty: choose a new directory for the grown run")
    source_cfg = trainer.load_run_config(source_workdir)
    cfg = grown_config(source_cfg, preset, [*overrides, f"workdir={workdir}"])
    sources = layer_sources(source_cfg.model.n_layers, cfg.model.n_layers)
    src_setup, src_state = trainer.restore_run(source_cfg, step, shard_tokens=False, report=report)
    src_step = int(src_state.step)
    report(f"source: {source_workdir} at step {src_step}, {source_cfg.model.n_layers} layers -> {cfg.model.n_layers}")

    corpus = data.load_corpus(source_cfg.data, source_workdir, source_cfg.model.vocab_size, save_tokenizer=False)
    seq_len = min(trainer.seq_len_of(source_cfg), cfg.model.max_seq_len)
    n_seq = max(1, min(STAT_SEQUENCES, (len(corpus.eval) - 1) // seq_len))
    tokens = data.eval_batch(corpus.eval, 0, num_batches=1, batch_size=n_seq, seq_len=seq_len)[:, :-1]
    source_stats = _measure(source_cfg, src_setup, src_state.params, tokens)

    setup, state = run_state(cfg, grow_params(src_state.params, sources, full_copies=full_copies), step=src_step)
    with sharding.mesh_context(setup.mesh):
        state = grow_training_state(src_state, state, sources)
    del src_state
    grown_stats = _measure(cfg, setup, state.params, tokens)
    save_run(cfg, setup, state, tokenizer_from=source_workdir)
    result = {
        "source": str(source_workdir),
        "source_step": src_step,
        "source_preset": source_cfg.preset,
        "preset": cfg.preset,
        "commit": code_commit(),
        "layout": "full copies" if full_copies else "quiet copies",
        "layer_sources": sources,
        "tokens": int(tokens.size),
        "source_layers": source_stats,
        "layers": grown_stats,
    }
    (workdir / GROW_FILE).write_text(json.dumps(result, indent=1) + "\n")
    return result
