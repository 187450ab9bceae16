"""`jax-twell bench`: a sparse-FFN model against its dense baselines of the same shape, end to end.

Three models of one preset are built in one process on one device: ``sparse`` (the
``SparseFFN``, ReLU gate, the run's implementation, by default the library's), ``swiglu``
(``DenseFFN``, SiLU gate) and ``dense_relu`` (``DenseFFN``, ReLU gate). The sparse model
takes a run's checkpoint (``workdir``; restored as ``eval`` and ``generate`` do) or fresh
weights, whose activations are not sparse, so that its speed figures then mean nothing;
the baselines take fresh weights (a dense model's speed does not depend on them). For
serving, the sparse model is calibrated on sample tokens and keeps the decode layouts
(``TransformerLM.calibrate_ffn``, ``cache_for_decode``), as the library serves a
trained model.

Measured, each case timed in interleaved rounds across the three models
(``bench_measure.time_rounds``; compilation is done ahead and never timed):

- prefill: ``model.prefill`` of ``[B, T]`` tokens into a cache of ``T``, last logits only;
- decode: ``models.generate`` (greedy) of ``new_tokens`` after a ``prompt``-token prompt,
  tokens/s counting the new tokens over the whole call (its prompt prefill included);
- training: the training loop's jitted step (``train.step.make_train_step``: loss, L1,
  gradients, AdamW), tokens/s and MFU from the dense model's FLOPs (``train.metrics``);
- memory: what each compiled program holds on the device (``bench_measure.compiled_peak_bytes``),
  the training step's and the largest serving program's; and the allocator's process-wide
  high-water mark where the device reports one;
- energy per token: NVML power integrated over the timed windows (GPUs with nvidia-ml-py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jax_twell.models import TransformerLM, generate
from jax_twell.train import bench_measure as measure
from jax_twell.train import bench_report as report
from jax_twell.train import config as config_lib
from jax_twell.train import data, ffn_paths, metrics, sharding
from jax_twell.train.checkpoint import Checkpointer
from jax_twell.train.optimizer import learning_rate_schedule, make_optimizer
from jax_twell.train.state import setup_model
from jax_twell.train.step import make_train_step

MODELS = {"sparse": "sparse_relu", "swiglu": "dense_silu", "dense_relu": "dense_relu"}
CALIBRATION_TOKENS = 16_384  # at most this many sample tokens calibrate the sparse model's serving


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to measure (the command's options; see ``jax-twell bench --help``).

    prefill: ``(batch, sequence)`` shapes; decode: batch sizes; prompt / new_tokens: the
    decode cases' prompt and generated lengths; train_steps: training steps per timed
    window at least (0: no training case); repeats: timed rounds; warmup: untimed calls
    per program; min_seconds: shortest timed window (calls are repeated to fill it);
    power_interval: seconds between power readings; data: "corpus" (the run's data),
    "random" (uniform tokens) or "auto" (corpus with a workdir, else random);
    calibrate: calibrate the sparse model's serving on sample tokens.
    """

    prefill: tuple[tuple[int, int], ...] = ((1, 2048), (8, 2048), (32, 2048))
    decode: tuple[int, ...] = (1, 8, 64)
    prompt: int = 512
    new_tokens: int = 256
    train_steps: int = 2
    repeats: int = 5
    warmup: int = 2
    min_seconds: float = 0.5
    power_interval: float = 0.01
    data: str = "auto"
    calibrate: bool = True


def fit_shapes(cfg: config_lib.TrainConfig, options: BenchOptions) -> tuple[list, int, int, list[str]]:
    """The prefill shapes, prompt and new tokens cut to the model's context, and a note for
    each cut: ``(prefill, prompt, new_tokens, notes)``."""
    context, notes, prefill = cfg.model.max_seq_len, [], []
    for batch, seq in options.prefill:
        if seq > context:
            notes.append(f"prefill {batch}x{seq} measured as {batch}x{context}: the model's context is {context}")
        if (batch, min(seq, context)) not in prefill:
            prefill.append((batch, min(seq, context)))
    prompt, new = options.prompt, options.new_tokens
    if options.decode and prompt + new > context:
        prompt = max(1, prompt * context // (prompt + new))
        new = context - prompt
        notes.append(
            f"decode prompt {options.prompt} + {options.new_tokens} new tokens exceeds the model's context of "
            f"{context}: measured as a prompt of {prompt} and {new} new tokens (same proportion)"
        )
    return prefill, prompt, new, notes


class _Tokens:
    """Token batches for every case: windows of the run's corpus or uniform random ids."""

    def __init__(self, cfg: config_lib.TrainConfig, source: str, workdir: str | None):
        self.cfg, self._rng = cfg, np.random.default_rng(cfg.seed)
        self.corpus = None
        if source == "corpus":
            self.corpus = data.load_corpus(cfg.data, workdir or cfg.workdir, cfg.model.vocab_size, save_tokenizer=False)
            self.description = f"the run's corpus ({self.corpus.description}): held-out split for serving, training split for training"
        else:
            self.description = f"uniform random token ids in [0, {cfg.model.vocab_size})"

    def get(self, batch: int, seq: int, *, split: str = "eval", index: int = 0) -> np.ndarray:
        """``[batch, seq]`` int32 tokens."""
        if self.corpus is None:
            return self._rng.integers(0, self.cfg.model.vocab_size, (batch, seq), dtype=np.int32)
        tokens = self.corpus.eval if split == "eval" else self.corpus.train
        return data.batch_at(tokens, index, seed=self.cfg.seed, batch_size=batch, seq_len=seq - 1)


def _restore(setup, workdir: str, step: int | None, report_line) -> tuple[object, int]:
    checkpointer = Checkpointer(workdir, 0, read_only=True)
    try:
        if step is None:
            restored, state, _ = checkpointer.restore_newest(setup.abstract_state, report_line)
            return state, restored
        return checkpointer.restore(setup.abstract_state, step), step
    finally:
        checkpointer.close()


def run_bench(
    cfg: config_lib.TrainConfig,
    options: BenchOptions,
    *,
    workdir: str | None = None,
    step: int | None = None,
    console=None,
) -> dict:
    """Runs the benchmark of ``cfg`` (a preset's config, or with ``workdir`` the run's own,
    its checkpoint ``step``, default the newest that loads, as the sparse model's weights)
    on the first device; returns the result (``bench_report.summarize``'s dictionary).
    Raises ValueError for a run whose model is not a sparse one, and
    ``checkpoint.RestoreError`` when no checkpoint loads."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    if cfg.model.ffn != "sparse_relu":
        raise ValueError(f"the run's FFN is {cfg.model.ffn!r}: bench compares a sparse_relu model to its dense baselines")
    device = jax.devices()[0]
    prefill, prompt, new, notes = fit_shapes(cfg, options)
    decode = list(options.decode)
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    tokens = _Tokens(cfg, options.data if options.data != "auto" else ("corpus" if workdir else "random"), workdir)
    mesh = sharding.make_mesh(config_lib.MeshConfig(1, 1, 1), [device])
    tx = make_optimizer(cfg.optim, cfg.steps)
    schedule = learning_rate_schedule(cfg.optim, cfg.steps)
    sampler, power_reason = measure.open_power_sampler(device, options.power_interval)
    cases, weights = {}, {"source": "fresh", "workdir": workdir, "step": None}
    models, serve_notes = {}, {}
    with sharding.mesh_context(mesh), report.progress(console) as bar, (sampler or contextlib.nullcontext()):
        task = bar.add_task("building models", total=None)
        for name, kind in MODELS.items():
            model_cfg = dataclasses.replace(cfg.model, ffn=kind)
            setup = setup_model(model_cfg, cfg.seed, tx, mesh)
            if name == "sparse" and workdir:
                say = lambda m: console.print(f"[yellow]{escape(m)}[/]", highlight=False)
                state, weights["step"] = _restore(setup, workdir, step, say)
                weights["source"] = "checkpoint"
            else:
                state = setup.init()
            models[name] = {"cfg": dataclasses.replace(cfg, model=model_cfg), "setup": setup, "state": state}
        if weights["source"] == "fresh":
            weights["note"] = (
                "fresh weights: the sparse model's activations are not sparse (about half its neurons fire), "
                "so its speed, memory and energy figures mean nothing for a trained model; give --workdir"
            )
        units = len(MODELS) * (len(prefill) + len(decode) + (options.train_steps > 0))
        bar.update(task, total=units * (options.warmup + options.repeats) + 1, completed=0)
        advance = lambda: bar.advance(task)
        if prefill or decode:
            serving = _serving_programs(models, prefill, decode, prompt, new, tokens, options, mesh, serve_notes, bar, task)
            for case, programs in serving.items():
                bar.update(task, description=f"timing {case}")
                cases[case] = _time_case(programs, options, advance)
            del serving
        if options.train_steps > 0:
            bar.update(task, description="compiling the training steps")
            programs = _train_programs(models, tokens, mesh, tx, schedule)
            bar.update(task, description="timing the training steps")
            cases["train"] = _time_case(programs, options, advance, min_calls=options.train_steps)
        bar.update(task, description="done")
        bar.advance(task)
        if sampler is not None:
            time.sleep(2 * options.power_interval)  # a reading after the last window
    energy = {"reading": sampler.reading if sampler else None, "interval_s": options.power_interval, "reason": power_reason}
    for case in cases.values():
        for row in case["models"].values():
            windows = row.pop("windows")
            joules = [sampler.energy(a, b) for a, b in windows] if sampler else [None]
            total = None if None in joules else sum(joules)
            row["joules_per_token"] = None if total is None else total / (len(windows) * row["calls"] * case["tokens_per_call"])
    return report.summarize(
        metadata=measure.run_metadata(device),
        cfg=cfg,
        weights=weights,
        data=tokens.description,
        options=options,
        shapes={"prefill": prefill, "decode": decode, "prompt": prompt, "new_tokens": new},
        notes=notes,
        models={
            name: dict(
                ffn=m["cfg"].model.ffn,
                gated=m["cfg"].model.gated,
                implementation=m["cfg"].model.ffn_implementation if name == "sparse" else "xla",
                params=m["setup"].num_params,
                serving=serve_notes.get(name, "as built"),
            )
            for name, m in models.items()
        },
        cases=cases,
        peak_flops=metrics.peak_flops_per_device(device, cfg.peak_tflops),
        device_memory=measure.device_memory(device),
        energy=energy,
    )


def _serving_model(name, entry, tokens, options, serve_notes):
    """The model as served on one device: a plain ``TransformerLM`` (no FFN sharding) on the
    state's parameters; the sparse one calibrated on sample tokens and holding the decode
    layouts. Returns ``nnx.split`` of it."""
    model_cfg = dataclasses.replace(entry["cfg"].model, ffn_sharding=None)
    graphdef = nnx.split(nnx.eval_shape(lambda: TransformerLM(model_cfg, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
    model = nnx.merge(graphdef, entry["state"].params, entry["setup"].rest)
    if name == "sparse" and options.calibrate:
        seq = model_cfg.max_seq_len
        sample = tokens.get(max(1, min(8, CALIBRATION_TOKENS // seq)), seq, index=1)
        fractions = model.calibrate_ffn(sample)
        model.cache_for_decode(activation_weight=True)
        over = [layer.ffn.overflow_fraction for layer in model.layers if layer.ffn.overflow_fraction is not None]
        serve_notes[name] = (
            f"calibrated on {sample.size:,} tokens (active fraction per layer "
            f"{', '.join(f'{f:.4f}' for f in fractions)}; tokens past the warp layout "
            f"{', '.join(f'{f:.4f}' for f in over)}); decode layouts kept (w_up.T, w_act.T)"
        )
    return nnx.split(model)


def _serving_programs(models, prefill, decode, prompt, new, tokens, options, mesh, serve_notes, bar, task) -> dict:
    """Per serving case: ``{"tokens_per_call", "kind", "programs": {name: (compiled, args)}}``,
    every program compiled."""
    split = {}
    for name, entry in models.items():
        bar.update(task, description=f"preparing {name} for serving")
        split[name] = _serving_model(name, entry, tokens, options, serve_notes)
    out = {}
    for batch, seq in prefill:
        ids = jax.device_put(tokens.get(batch, seq, index=2))
        case = out[f"prefill_{batch}x{seq}"] = {"kind": "prefill", "batch": batch, "seq": seq, "tokens_per_call": batch * seq, "programs": {}}
        for name, (graphdef, state) in split.items():
            bar.update(task, description=f"compiling {name} prefill {batch}x{seq}")
            fn = lambda state, ids, graphdef=graphdef, seq=seq: nnx.merge(graphdef, state).prefill(ids, seq, last_only=True)
            case["programs"][name] = (jax.jit(fn).lower(state, ids).compile(), (state, ids))
    for batch in decode:
        ids = jax.device_put(tokens.get(batch, prompt, index=3))
        case = out[f"decode_b{batch}"] = {"kind": "decode", "batch": batch, "prompt": prompt, "new_tokens": new, "tokens_per_call": batch * new, "programs": {}}
        for name, (graphdef, state) in split.items():
            bar.update(task, description=f"compiling {name} decode batch {batch}")
            fn = lambda state, ids, graphdef=graphdef: generate(nnx.merge(graphdef, state), ids, new, temperature=0.0)
            case["programs"][name] = (jax.jit(fn).lower(state, ids).compile(), (state, ids))
    return out


def _train_programs(models, tokens, mesh, tx, schedule) -> dict:
    """The training case: the training loop's step of every model, compiled, its state
    threaded through the calls (donated)."""
    first = next(iter(models.values()))["cfg"]
    seq, accum = config_lib.seq_len_of(first), first.grad_accum
    batch = tokens.get(first.batch_size, seq + 1, split="train").reshape(accum, -1, seq + 1)
    batch = sharding.put_batch(batch, sharding.batch_sharding(mesh, 3))
    case = {"kind": "train", "batch": first.batch_size, "grad_accum": accum, "seq": seq,
            "tokens_per_call": first.batch_size * seq, "programs": {}, "flops_per_token": {}, "d_ff": {}}
    for name, entry in models.items():
        cfg, setup, state = entry["cfg"], entry["setup"], entry.pop("state")
        traced = setup
        if ffn_paths.enabled(cfg.model):  # the sides the run's layers had, as the training loop traces them
            traced = ffn_paths.with_paths(setup, tuple(bool(v) for v in jax.device_get(state.ffn_sparse)))
        compiled = make_train_step(cfg, traced, tx, schedule).lower(state, batch).compile()
        case["programs"][name] = (compiled, [state, batch])
        case["flops_per_token"][name] = metrics.flops_per_token(setup.num_params, setup.num_layers, cfg.model.d_model, seq)
        case["d_ff"][name] = cfg.model.d_ff
    return case


def _time_case(case: dict, options: BenchOptions, advance, min_calls: int = 1) -> dict:
    """Times one case's programs (:func:`bench_measure.time_rounds`); the case's description
    with a row per model: seconds, spread, calls, tokens/s, peak bytes, windows."""
    programs = case.pop("programs")
    runners, step_stats = {}, {}
    for name, (compiled, args) in programs.items():
        if case["kind"] == "train":
            step_stats[name] = held = {}

            def run(compiled=compiled, args=args, held=held):
                args[0], out = compiled(*args)  # the state, donated and replaced
                held.setdefault("first", out["nnz_mean"])  # device arrays: read after the timing
                held["last"] = out["nnz_mean"]
                return args[0]
        else:
            run = lambda compiled=compiled, args=args: compiled(*args)
        runners[name] = run
    timings = measure.time_rounds(
        runners, warmup=options.warmup, repeats=options.repeats, min_seconds=options.min_seconds,
        min_calls=min_calls, advance=advance,
    )
    case["models"] = {
        name: dict(
            seconds=t.seconds, spread=t.spread, calls=t.calls, tokens_per_s=case["tokens_per_call"] / t.seconds,
            peak_bytes=measure.compiled_peak_bytes(programs[name][0]), windows=t.windows,
        )
        for name, t in timings.items()
    }
    # Each layer's active fraction in the first and the last step run (warm-up included):
    # the steps update the weights, so a model's sparsity may move while it is timed.
    d_ff = case.pop("d_ff", {})
    for name, held in step_stats.items():
        if "first" in held:
            case["models"][name]["active_fraction_steps"] = {
                k: [round(float(v) / d_ff[name], 6) for v in jax.device_get(held[k])] for k in ("first", "last")
            }
    return case


def write_outputs(result: dict, out: str | Path, png: str | Path) -> tuple[Path, Path]:
    """Writes the result's JSON to ``out`` and its ratio chart to ``png``; returns both paths."""
    out, png = Path(out), Path(png)
    result["files"] = {"json": str(out), "png": str(png)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    report.plot_ratios(result, png)
    return out, png
