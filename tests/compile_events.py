"""Which programs XLA compiles while a block runs: ``with compiled() as names: ...`` collects
the name of each program compiled meanwhile, from any thread (the pipeline's programs compile
on a pool), as JAX reports it (``/jax/core/compile/backend_compile_duration``)."""

import contextlib
from collections.abc import Iterator

import jax

# Per recording in progress, the names of the programs XLA compiled.
_recordings: list[list[str]] = []


def _record(event: str, duration: float, fun_name: str = "", **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        for names in _recordings:
            names.append(fun_name)


jax.monitoring.register_event_duration_secs_listener(_record)


@contextlib.contextmanager
def compiled() -> Iterator[list[str]]:
    names: list[str] = []
    _recordings.append(names)
    try:
        yield names
    finally:
        _recordings.remove(names)
