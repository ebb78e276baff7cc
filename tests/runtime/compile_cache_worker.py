"""One run of a small pipelined step with JAX's persistent compilation cache in CACHE_DIR:
python compile_cache_worker.py CACHE_DIR. Prints one JSON line: the cache's hits and misses, and
the programs XLA compiled (or read from the cache), while compiling and running the first step.
Its test (test_compile_ahead.py) puts the repository and tests/ on its PYTHONPATH."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
# JAX writes only programs compiling for at least a second by default: the stage programs of a
# small model compile faster (docs/compilation.md: the persistent compilation cache).
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import make_state  # noqa: E402

model = GPT(num_stages=2, num_layers=2)
batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
state = make_state(model, batch["x"][:1])
step = supervised_step(gpt_loss)
events = {"cache_hits": 0, "cache_misses": 0}
programs: list[str] = []


def on_event(event, **_):
    name = event.rsplit("/", 1)[-1]
    if event.startswith("/jax/compilation_cache/") and name in events:
        events[name] += 1


def on_duration(event, duration, fun_name="", **_):
    if event == "/jax/core/compile/backend_compile_duration":
        programs.append(fun_name)


jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
    num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]))
new_state, loss = parallel(state, batch)
print(json.dumps({**events, "programs": programs, "loss": float(loss)}), flush=True)
