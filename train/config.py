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
    from step 0). batch_size counts sequences per optimizer step over all devices and hosts;
    with `grad_accum` > 1 each step runs that many micro-batches of batch_size / grad_accum.
    seq_len 0 means the model's context length. dead_reinit re-initialises gate columns that
    have not fired for `dead_window` steps (docs/design.md, section 6, Model and training
    recipe). peak_tflops overrides the per-device peak used for MFU (0: look it up from the
    device kind).
    """

    model: ModelConfig
    preset: str = "tiny"
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    mesh: MeshConfig = MeshConfig()
    l1_coef: float = 1e-3
    l1_warmup_steps: int = 0
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
    except ValueError as e:
        raise ValueError(f"config key {full_key!r}: {e}") from None
    return dataclasses.replace(obj, **{keys[0]: value})


def apply_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """Returns `cfg` with each `key=value` (dotted keys reach nested fields) applied."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        cfg = _replace_path(cfg, key.strip().split("."), text.strip(), key.strip())
    return cfg


def get_config(preset: str, overrides: list[str] = ()) -> TrainConfig:
    """The named preset with `overrides` applied; raises KeyError for unknown presets."""
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return apply_overrides(PRESETS[preset], list(overrides))


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
    """Reads a config written by `save`."""
    return from_dict(json.loads(Path(path).read_text()))


def seq_len_of(cfg: TrainConfig) -> int:
    """Training sequence length: cfg.seq_len, or the model's context when 0."""
    return cfg.seq_len or cfg.model.max_seq_len
