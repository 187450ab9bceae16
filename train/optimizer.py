"""AdamW with linear warm-up, cosine decay and global-norm gradient clipping (paper recipe)."""

from __future__ import annotations

import jax
import optax

from jax_twell.train.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """step -> lr: linear 0 -> cfg.lr over warmup_steps, cosine down to lr * final_lr_ratio at total_steps."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.final_lr_ratio,
    )


def _decay_mask(params):
    # Weight decay on matrices only: norm scales (1-D) are not decayed.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) then AdamW(b1, b2, eps, weight_decay) on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )
