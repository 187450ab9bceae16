"""Dead-neuron tracking and gate re-initialisation, from the paper's appendix.

See docs/design.md, section 6 (Model and training recipe).

Every step records, per layer and FFN neuron, how many steps have passed since it last
fired (was non-zero for any token). A neuron silent for `dead_window` steps counts as
dead; with `dead_reinit`, after each step its gate column is nudged back towards a fresh
initialisation:

    Wg[:, j] <- 0.9 * Wg[:, j] + 0.1 * N(0, 0.02^2)

For the non-gated FFN (h = relu(x @ Wu)) the "gate" is Wu.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REINIT_KEEP = 0.9
REINIT_STD = 0.02


def gate_weight_name(ffn_params: dict) -> str:
    """The key of the weight whose ReLU decides firing: "w_gate", or "w_up" when non-gated."""
    return "w_gate" if "w_gate" in ffn_params else "w_up"


def update_since_fired(since_fired: jax.Array, fired: jax.Array) -> jax.Array:
    """since_fired: [L, f] int32, fired: [L, f] bool -> [L, f] int32 (0 where fired, else +1)."""
    return jnp.where(fired, 0, since_fired + 1)


def reinit_dead_gates(params: dict, dead: jax.Array, rng: jax.Array) -> dict:
    """Nudges the gate columns marked in `dead` ([L, f] bool) towards N(0, 0.02^2).

    params: the model's pure parameter dict (layers at params["layers"][i]["ffn"]); gate
    weights [d, f]. Returns new params; other columns and weights are unchanged.
    """
    layers = dict(params["layers"])
    for i, key in enumerate(sorted(layers, key=int)):
        ffn = dict(layers[key]["ffn"])
        name = gate_weight_name(ffn)
        w = ffn[name]
        noise = REINIT_STD * jax.random.normal(jax.random.fold_in(rng, i), w.shape, w.dtype)
        ffn[name] = jnp.where(dead[i][None, :], REINIT_KEEP * w + (1 - REINIT_KEEP) * noise, w)
        layers[key] = {**layers[key], "ffn": ffn}
    return {**params, "layers": layers}
