"""Test setup: 8 virtual CPU devices, set before any JAX backend starts."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)
# Verifiers type-check every jaxpr a pass makes, here and in the processes tests launch
# (``meshpar.passes.verification``).
os.environ.setdefault("MESHPAR_VERIFY", "full")


def pytest_report_header(config):
    import flax
    import jaxlib
    import optax

    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, optax {optax.__version__}"
