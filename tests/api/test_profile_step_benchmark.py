"""``benchmarks.profile_step --handlers``: every step-instruction kind the step runs gets a row,
and the fixed host work line is the sum of the rows it names (run in its own process: the option
wraps the runtime's handler registry for the whole process)."""

import re
import subprocess
import sys

from repo_paths import ROOT_DIR


def test_handlers_report_a_row_per_kind_and_sum_the_fixed_host_work():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_step", "--handlers", "--steps", "2", "--micro-batches", "2",
         "--layout", "two_meshes_1f1b"],
        cwd=ROOT_DIR, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    # Per row, the wall and the CPU µs per step.
    rows = {name: (int(wall), int(cpu)) for name, wall, cpu in
            re.findall(r"^\| ([^|]+?) \|[^|]*\| (\d+) \| (\d+) \|$", result.stdout, re.M)}
    # The kinds a two-mesh step runs, each through its registered handler.
    for kind in ("PlaceInputs", "RunCompute", "FeedValue", "SliceMicroBatches", "RunPipeline",
                 "CombineMicroBatches", "ReduceGradient", "AwaitArrivals", "AssembleOutputs", "ShareOutputs"):
        assert kind in rows, (kind, result.stdout)
    named = ("PlaceInputs", "AssembleOutputs", "ShareOutputs", "CombineMicroBatches",
             "the argument cache key (signatures of the leaves)")
    fixed = next(v for k, v in rows.items() if k.startswith("fixed host work"))
    for column in (0, 1):
        assert abs(fixed[column] - sum(rows[k][column] for k in named)) <= len(named)  # each row rounded
    # A thread's CPU time cannot exceed the wall time it ran for (the clocks' rounding aside).
    assert all(cpu <= 1.1 * wall + 50 for wall, cpu in rows.values()), result.stdout


def test_launches_report_each_stage_program_as_launched_and_with_its_operands_ready():
    """``--launches``: per stage program, one row as the step launches it and one with its
    operands made ready first, each from the launches of its own rounds."""
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_step", "--launches", "--steps", "2", "--micro-batches", "2",
         "--layout", "one_mesh_interleaved"],
        cwd=ROOT_DIR, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = re.findall(r"^\| (\w+) \| (as launched|ready) \| (\d+) \| (\d+) / (\d+) \| (\d+) / (\d+) \|$",
                      result.stdout, re.M)
    seen = {(name, mode): int(count) for name, mode, count, *_ in rows}
    # Two stages on one mesh, 2 micro-batches, 2 steps a mode: each pass launched 2 x 2 x 2 times.
    assert seen == {(p, m): 8 for p in ("forward", "backward") for m in ("as launched", "ready")}, result.stdout
    for *_, wall50, wall90, cpu50, cpu90 in rows:
        assert int(wall50) <= int(wall90) and int(cpu50) <= int(cpu90)
