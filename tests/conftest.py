"""Test setup: 8 virtual CPU devices, set before any JAX backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)


def pytest_report_header(config):
    import flax
    import jaxlib
    import optax

    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, flax {flax.__version__}, optax {optax.__version__}"
