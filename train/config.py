"""Training configuration: plain frozen dataclasses, presets, `key=value` overrides.

A run is fully described by one `TrainConfig`. Presets give sensible values per model
size; any field, nested ones included, can be overridden from the command line with a
dotted key (`optim.lr=3e-3`, `model.n_layers=2`, `data.source=~/notes`). The config is
written as JSON into the run directory, and `--resume`, `eval` and `generate` read it back.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any

from jax_twell.models import PRESETS as MODEL_PRESETS
from jax_twell.models import ModelConfig


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from (see `jax_twell.train.data`).

    source: "stdlib" (the Python standard library's own sources and docs, present on any
      machine), or comma-separated paths: text files, folders of text files, or
      pre-tokenized token files (`.npy`, raw `.u16`/`.u32`/`.bin`).
    tokenizer: "byte" (256 symbols, no training) or "bpe" (trained offline on the training
      split with the optional `tokenizers` package; its vocabulary is the model's).
    eval_percent: share of files (by a hash of their path) held out for evaluation; for a
      single token file, the share of tokens at its end.
    token_dtype: dtype of raw `.bin` token files.
    """

    source: str = "stdlib"
    tokenizer: str = "byte"
    eval_percent: float = 2.0
    token_dtype: str = "uint16"


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up and cosine decay to `lr * final_lr_ratio`, grad clip."""

    lr: float = 1e-3
    warmup_steps: int = 600
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape over the axes (data, fsdp, tensor); one entry may be -1 (fill)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    l1_coef multiplies the mean over layers of the per-token sum of |h| (docs/design.md,
    section 1, The job); it ramps linearly from 0 over `l1_warmup_steps` (0: full strength
    from step 0). l1_target (0: off) is a ceiling on each layer's active fraction: a layer
    whose mean fraction of active neurons on a step's batch is above it has its L1 term
    multiplied by fraction / l1_target in that step's loss (never below 1), so the layers
    that stay dense under one coefficient are pushed harder and the others are not
    (`jax_twell.train.loss.lm_loss`). batch_size counts sequences per optimizer step over all devices and hosts;
    with `grad_accum` > 1 each step runs that many micro-batches of batch_size / grad_accum.
    seq_len 0 means the model's context length. dead_reinit re-initialises gate columns that
    have not fired for `dead_window` steps (docs/design.md, section 6, Model and training
    recipe). peak_tflops overrides the per-device peak used for MFU (0: look it up from the
    device kind; MFU is not reported where the peak is unknown, CPUs included).
    keep_checkpoints 0 keeps every checkpoint. nonfinite: what a step whose loss, gradient
    norm or update is not finite (NaN or Inf) does: "stop" ends the run with an error,
    "skip" drops that step's update (the state stays as before it) and ends the run only
    after `nonfinite_skip_limit` such steps in a row. Either way no such state is ever
    checkpointed.
    """

    model: ModelConfig
    preset: str = "tiny"
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    l1_coef: float = 1e-3
    l1_warmup_steps: int = 0
    l1_target: float = 0.0
    steps: int = 300
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int = 0
    seed: int = 0
    dead_reinit: bool = False
    dead_window: int = 100
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    workdir: str = "runs/tiny"
    peak_tflops: float = 0.0
    nonfinite: str = "stop"
    nonfinite_skip_limit: int = 10


def _preset(name: str, **fields: Any) -> TrainConfig:
    return TrainConfig(model=MODEL_PRESETS[name], preset=name, workdir=f"runs/{name}", **fields)


# Small presets use a scaled-down recipe (short warm-up, higher peak lr, L1 1e-3). The
# measured sweep (benchmarks/results/l1_sweep_small: 2,000 steps of the small preset on an
# H200 for L1 in {0, 2e-5, 1e-4, 3e-4, 1e-3, 3e-3}) gives 99.76% sparsity at 1e-3 with
# held-out CE 2.2% below the dense-ReLU baseline. Paper presets use the paper's L1 of 2e-5.
_PAPER = dict(
    optim=OptimConfig(),
    l1_coef=2e-5,
    batch_size=512,
    steps=20_000,
    log_every=50,
    eval_every=1000,
    checkpoint_every=1000,
    data=DataConfig(tokenizer="bpe"),
)
# The hardware each preset is meant for, and its time there (command-line help, hints).
PRESET_HARDWARE = {
    "tiny": "CPU, a few minutes",
    "small": "one GPU, minutes (on a CPU about a minute per step)",
    "0.5b": "GPUs, hours",
    "1b": "GPUs, hours",
    "1.5b": "GPUs, hours to days",
    "2b": "GPUs, hours to days",
}
PRESETS: dict[str, TrainConfig] = {
    "tiny": _preset(
        "tiny",
        optim=OptimConfig(lr=3e-3, warmup_steps=30),
        steps=300,
        batch_size=16,
    ),
    "small": _preset(
        "small",
        optim=OptimConfig(lr=3e-3, warmup_steps=100),
        steps=2000,
        batch_size=64,
        log_every=20,
        eval_every=250,
        checkpoint_every=250,
    ),
    **{name: _preset(name, **_PAPER) for name in ("0.5b", "1b", "1.5b", "2b") if name in MODEL_PRESETS},
}


def _parse_value(text: str, current: Any, annotation: Any) -> Any:
    """Parses `text` into the type of the field it overrides."""
    kind = type(current) if current is not None else annotation
    if kind is bool:
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected a boolean, got {text!r}")
        return lowered in ("true", "1", "yes")
    if kind is int:
        return int(float(text)) if "e" in text.lower() else int(text)
    if kind is float:
        return float(text)
    if kind is str:
        return text
    if kind is tuple or typing.get_origin(annotation) is tuple:
        value = ast.literal_eval(text)
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _replace_path(obj: Any, keys: list[str], text: str, full_key: str) -> Any:
    names = {f.name: f for f in dataclasses.fields(obj)}
    if keys[0] not in names:
        raise KeyError(f"unknown config key {full_key!r}; {type(obj).__name__} has: {', '.join(names)}")
    current = getattr(obj, keys[0])
    if len(keys) > 1:
        if not dataclasses.is_dataclass(current):
            raise KeyError(f"config key {full_key!r}: {keys[0]!r} has no sub-fields")
        return dataclasses.replace(obj, **{keys[0]: _replace_path(current, keys[1:], text, full_key)})
    if dataclasses.is_dataclass(current):
        raise KeyError(f"config key {full_key!r} is a group; set one of its fields ({full_key}.name=value)")
    annotation = typing.get_type_hints(type(obj)).get(keys[0])
    try:
        value = _parse_value(text, current, annotation)
        return dataclasses.replace(obj, **{keys[0]: value})  # ModelConfig checks its own fields here
    except ValueError as e:
        raise ValueError(f"config key {full_key!r}: {e}") from None


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Returns `cfg` with each `key=value` (dotted keys reach nested fields) applied."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        cfg = _replace_path(cfg, key.strip().split("."), text.strip(), key.strip())
    return cfg


def get_config(preset: str, overrides: list[str] = ()) -> TrainConfig:
    """The named preset with `overrides` applied and validated (`validate`); raises
    KeyError for unknown presets and keys, ValueError for bad values."""
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return validate(apply_overrides(PRESETS[preset], list(overrides)))


def to_dict(cfg: Any) -> dict:
    """A JSON-ready dict of a (nested) config dataclass."""
    return dataclasses.asdict(cfg)


def _from_dict(cls: type, values: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name not in values:
            continue
        value, hint = values[field.name], hints[field.name]
        if dataclasses.is_dataclass(hint):
            value = _from_dict(hint, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[field.name] = value
    return cls(**kwargs)


def from_dict(values: dict) -> TrainConfig:
    """Inverse of `to_dict` for `TrainConfig`."""
    return _from_dict(TrainConfig, values)


def save(cfg: TrainConfig, path: str | Path) -> None:
    """Writes `cfg` as JSON to `path`."""
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def load(path: str | Path) -> TrainConfig:
    """Reads a config written by `save`; errors name the file and what is wrong in it."""
    path = Path(path)
    try:
        values = json.loads(path.read_text())
    except OSError as e:
        raise FileNotFoundError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid JSON config ({e}); fix it or start a new run") from None
    try:
        if not isinstance(values, dict) or not isinstance(values.get("model"), dict):
            raise ValueError("expected a JSON object with a 'model' section")
        unknown = _unknown_keys(TrainConfig, values)
        if unknown:
            raise ValueError(f"unknown fields {', '.join(unknown)}")
        return from_dict(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path} does not hold a valid training config: {e}") from None


def _unknown_keys(cls: type, values: dict, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [prefix + key for key in values if key not in names]
    for key in names & values.keys():
        if dataclasses.is_dataclass(hints[key]) and isinstance(values[key], dict):
            unknown += _unknown_keys(hints[key], values[key], f"{prefix}{key}.")
    return unknown


def seq_len_of(cfg: TrainConfig) -> int:
    """Training sequence length: cfg.seq_len, or the model's context when 0."""
    return cfg.seq_len or cfg.model.max_seq_len


class ConfigError(ValueError):
    """Configuration values out of range; the message names each field and its allowed range."""


@dataclasses.dataclass(frozen=True)
class _Range:
    """Allowed values of one field: a type, optional bounds, or a list of choices."""

    kind: type
    low: float | None = None
    high: float | None = None
    high_open: bool = False
    low_open: bool = False
    choices: tuple = ()
    allow_none: bool = False  # for fields without choices

    def accepts(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if value is None:
            return self.allow_none
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if self.kind is str:
            return bool(value.strip())
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {int: "an integer", float: "a finite number", bool: "true or false", str: "a non-empty string"}[self.kind]
        bounds = []
        number = (lambda v: str(int(v))) if self.kind is int else (lambda v: f"{v:g}")
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {number(self.low)}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {number(self.high)}")
        return name + (" " + " and ".join(bounds) if bounds else "")


_COUNT = _Range(int, 1)  # steps, sizes, intervals
_NON_NEGATIVE_INT = _Range(int, 0)
_NON_NEGATIVE = _Range(float, 0)
RANGES: dict[str, _Range] = {
    "preset": _Range(str),
    "data.source": _Range(str),
    "data.tokenizer": _Range(str),
    "data.eval_percent": _Range(float, 0, 100, low_open=True, high_open=True),
    "data.token_dtype": _Range(str, choices=("uint8", "uint16", "uint32", "int16", "int32", "int64")),
    "optim.lr": _NON_NEGATIVE,
    "optim.warmup_steps": _NON_NEGATIVE_INT,
    "optim.final_lr_ratio": _Range(float, 0, 1),
    "optim.weight_decay": _NON_NEGATIVE,
    "optim.b1": _Range(float, 0, 1, high_open=True),
    "optim.b2": _Range(float, 0, 1, high_open=True),
    "optim.eps": _Range(float, 0, low_open=True),
    "optim.grad_clip": _Range(float, 0, low_open=True),
    "l1_coef": _NON_NEGATIVE,
    "l1_warmup_steps": _NON_NEGATIVE_INT,
    "l1_target": _Range(float, 0, 1, high_open=True),
    "steps": _COUNT,
    "batch_size": _COUNT,
    "grad_accum": _COUNT,
    "seq_len": _NON_NEGATIVE_INT,
    "seed": _Range(int, 0, 2**32 - 1),
    "dead_reinit": _Range(bool),
    "dead_window": _COUNT,
    "log_every": _COUNT,
    "eval_every": _COUNT,
    "eval_batches": _COUNT,
    "checkpoint_every": _COUNT,
    "keep_checkpoints": _NON_NEGATIVE_INT,
    "workdir": _Range(str),
    "peak_tflops": _NON_NEGATIVE,
    "nonfinite": _Range(str, choices=("stop", "skip")),
    "nonfinite_skip_limit": _COUNT,
    "model.rope_theta": _Range(float, 0, low_open=True),
    "model.norm_eps": _Range(float, 0, low_open=True),
    "model.remat": _Range(bool),
    "model.gated": _Range(bool),
    "model.tie_embeddings": _Range(bool),
    "model.attention_implementation": _Range(str, choices=(None, "xla", "cudnn")),
}
_MESH_AXES = ("mesh.data", "mesh.fsdp", "mesh.tensor")


def field_value(cfg: Any, key: str) -> Any:
    """The value of dotted field `key` (e.g. "optim.lr") of a config dataclass."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def validate(cfg: TrainConfig) -> TrainConfig:
    """Returns `cfg` if every field is in range, else raises `ConfigError` listing each
    offending field with its value and allowed range (model sizes are checked by
    `ModelConfig` itself when it is built)."""
    problems = [
        f"{key}={field_value(cfg, key)!r}: must be {rule.describe()}"
        for key, rule in RANGES.items()
        if not rule.accepts(field_value(cfg, key))
    ]
    for key in _MESH_AXES:
        value = field_value(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value >= 1):
            problems.append(f"{key}={value!r}: must be an integer >= 1, or -1 (fill the remaining devices)")
    if sum(field_value(cfg, key) == -1 for key in _MESH_AXES) > 1:
        problems.append("mesh: at most one of data, fsdp, tensor may be -1")
    if not problems:  # relations between fields (their types are known to be right here)
        if cfg.batch_size % cfg.grad_accum:
            problems.append(f"batch_size={cfg.batch_size}: must be a multiple of grad_accum={cfg.grad_accum}")
        if cfg.seq_len > cfg.model.max_seq_len:
            problems.append(f"seq_len={cfg.seq_len}: must be <= model.max_seq_len={cfg.model.max_seq_len} (0: use it)")
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    return cfg


# Fields a resumed run cannot change: they shape the parameters held by the checkpoints
# (or, for the tokenizer, what the token ids mean).
FIXED_ON_RESUME = (
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.head_dim", "model.d_ff",
    "model.ffn", "model.gated", "model.param_dtype", "model.tie_embeddings", "model.n_kv_heads", "data.tokenizer",
)


def check_resume(saved: TrainConfig, cfg: TrainConfig) -> None:
    """Raises `ConfigError` when `cfg` (a saved run's config with overrides) changes a
    field the saved run's checkpoints fix (`FIXED_ON_RESUME`)."""
    changed = [
        f"{key} (saved run: {field_value(saved, key)!r}, requested: {field_value(cfg, key)!r})"
        for key in FIXED_ON_RESUME
        if field_value(saved, key) != field_value(cfg, key)
    ]
    if changed:
        raise ConfigError(
            "--resume cannot change " + "; ".join(changed) + ": the run's checkpoints hold parameters of the "
            "saved shape. Start a new run in another workdir=... to train a different model."
        )
