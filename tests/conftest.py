"""Test setup: 8 virtual CPU devices, set before any JAX backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
