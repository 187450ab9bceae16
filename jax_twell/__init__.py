"""jax-twell: sparse FFN blocks for JAX."""
