"""JSON-lines records from a benchmark's worker processes to its parent.

Each worker appends one JSON object per line to ``<directory>/p<process>.jsonl``,
flushed per record; the parent reads every file, skipping a last line still
being written, and while the workers run a ``ProgressPrinter`` prints what a
benchmark's ``report`` makes of the records so far.

Importing this module touches neither JAX nor the network.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ProgressPrinter", "RecordWriter", "read_records", "recording_outcome", "worker_env", "write_json"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class RecordWriter:
    """Appends records to ``<directory>/p<process>.jsonl``, each with ``fields`` added."""

    def __init__(self, directory: str, process: int, fields: Mapping[str, Any] | None = None) -> None:
        self._f = open(os.path.join(directory, f"p{process}.jsonl"), "a", buffering=1)
        self._fields = dict(fields or {})

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({**self._fields, **record}) + "\n")
        self._f.flush()


def recording_outcome(run: Callable[[], None], out: RecordWriter, process: int) -> None:
    """Runs ``run()``, then records ``{"kind": "done"}``; on an exception records
    ``{"kind": "error", ...}`` (message and traceback) first and re-raises, so the parent can
    report what failed where."""
    import traceback

    try:
        run()
    except BaseException as e:
        out.write({"kind": "error", "process": process, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]})
        raise
    out.write({"kind": "done", "process": process})


def write_json(path: str | None, records: list[dict]) -> None:
    """Writes ``records`` to ``path`` (if given) and says so."""
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {path}")


def read_records(directory: str) -> list[dict]:
    """Every complete record in ``directory``'s ``.jsonl`` files, file by file in name order."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                # A line still being written has no newline yet.
                out += [json.loads(line) for line in f if line.endswith("\n")]
    return out


class ProgressPrinter(threading.Thread):
    """Once a second, prints the lines ``report(records, elapsed_s)`` returns for the records in
    ``directory`` so far (``report`` remembers what it already printed). Records caught half
    written are left for the next poll. Stop with ``stop.set()``; ``poll()`` once more after."""

    def __init__(self, directory: str, report: Callable[[list[dict], float], list[str]], start: float) -> None:
        super().__init__(daemon=True)
        self.directory, self.report, self.start_time = directory, report, start
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            lines = self.report(read_records(self.directory), time.perf_counter() - self.start_time)
        except (OSError, ValueError, KeyError):
            return
        for line in lines:
            print(line, flush=True)


def worker_env() -> dict[str, str]:
    """``PYTHONPATH`` for a worker run as ``python -m benchmarks...`` from any directory."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([_REPO, path]) if path else _REPO}
