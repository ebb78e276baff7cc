"""Schedules as data: torch's CSV action format read and written, every built-in schedule through
a round trip, torch's own CSVs loaded, a loaded order checked like a built-in one (placement,
sizes, deadlocks), each bad input named, and a loaded order training equal to jax.jit."""

import re
from pathlib import Path

import numpy as np
import pytest

from repo_paths import TESTS_DIR

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.scheduling.pipeline_schedule import (
    SCHEDULES, StagePlacement, check_stage_placement, make_schedule,
)
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.pipeline.scheduling.schedule_csv import (
    format_schedule_csv, load_schedule_csv, parse_schedule_csv, save_schedule_csv,
)
from pipeline_models import assert_trees_close, make_state, mse, run_both

F, I, W = TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT
ARTIFACTS = Path(TESTS_DIR) / "artifacts"

# 1F1B on two meshes with two micro-batches, written by hand in torch's notation.
ONE_F_ONE_B = "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _sizes(name):
    """(P, v, M) sizes a built-in schedule takes: two and three meshes, a few micro-batch counts."""
    kind = SCHEDULES[name]
    v = kind.stages_per_mesh or (2 if kind.virtual_stages else 1)
    return [(P, v, M) for P in (2, 3) for M in (2 * P, 3 * P)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_built_in_schedule_round_trips_through_csv(name, tmp_path):
    """Saved and loaded, each built-in schedule (one per mesh, interleaved, V) gives the same
    tasks per mesh, placement, split and launch order; weight-delayed ones too."""
    for P, v, M in _sizes(name):
        S = P * v
        delays = None if SCHEDULES[name].places_weight_passes else (1,) * P
        for weight_delays in {None, delays}:
            built = make_schedule(name, S, M, _chain(S), weight_delays, num_meshes=P)
            path = tmp_path / f"{name}_{P}_{M}.csv"
            save_schedule_csv(built, path)
            kind = load_schedule_csv(path)
            assert (kind.name, kind.size, kind.stages_per_mesh) == (path.stem, (S, P, M), v)
            loaded = make_schedule(kind, S, M, _chain(S), num_meshes=P)
            assert loaded.sequences == built.sequences
            assert (loaded.stage_mesh, loaded.split_backward, loaded.order) == (
                built.stage_mesh, built.split_backward, built.order)
            assert format_schedule_csv(loaded.sequences) == path.read_text()


def test_the_format_is_torchs_one_rank_a_line():
    schedule = make_schedule("1f1b", 2, 2, [(0, 1)])
    assert format_schedule_csv(schedule.sequences) == ONE_F_ONE_B
    kind = parse_schedule_csv(ONE_F_ONE_B, "mine")
    assert kind.actions(2, 1, 2) == [list(seq) for seq in schedule.sequences]
    assert (kind.placement, kind.places_weight_passes, kind.virtual_stages) == (StagePlacement.LOOP, False, False)


def test_torchs_dualpipev_csv_loads_as_meshpars_dualpipev():
    """torch's golden DualPipeV CSV (whole backwards ``B``, overlapped ``(0F7;7B3)OVERLAP_F_B``
    pairs) loads on the V placement with every whole backward split, equal to ours."""
    kind = load_schedule_csv(ARTIFACTS / "dualpipev_4rank_10mb.csv")
    assert (kind.size, kind.placement, kind.places_weight_passes) == ((8, 4, 10), StagePlacement.V, True)
    assert kind.actions(4, 2, 10) == SCHEDULES["dualpipev"].actions(4, 2, 10)


def test_torchs_interleaved_zero_bubble_csv_with_idle_steps_loads():
    """torch writes idle steps as empty cells; they are skipped."""
    path = ARTIFACTS / "interleaved_zb_4rank_2stagep_8mb.csv"
    assert ",," in path.read_text()
    kind = load_schedule_csv(path)
    assert kind.actions(4, 2, 8) == SCHEDULES["interleaved_zb"].actions(4, 2, 8)


def test_a_whole_backward_among_split_ones_is_its_input_then_its_weight_pass():
    kind = parse_schedule_csv("0F0,0F1,0B0,0I1,0W1\n", "mixed")
    assert kind.actions(1, 1, 2) == [[Task(F, 0, 0), Task(F, 0, 1), Task(I, 0, 0), Task(W, 0, 0), Task(I, 0, 1),
                                      Task(W, 0, 1)]]
    assert kind.places_weight_passes


@pytest.mark.parametrize("text,match", [
    ("0F0,0SEND_F0,0B0\n", r"^schedule: line 1, column 2 \(rank 0\): '0SEND_F0' is torch's lowered SEND_F action"),
    ("0F0,0B0\n1F0,1X0,1B0\n", r"^schedule: line 2, column 2 \(rank 1\): '1X0' is not an action; expected a compute "
                               r"action <stage><F\|I\|W\|B><micro-batch>"),
    ("0F0,0REDUCE_GRAD\n", r"'0REDUCE_GRAD' is torch's lowered REDUCE_GRAD action"),
    ("0F0,1F0,1B0,0B0\n0F1\n", r"^schedule: stage 0 runs on rank 0 \(line 1, column 1\) and on rank 1 \(line 2, "
                              r"column 1\); a stage runs on one rank"),
    ("0F0,2F0,2B0,0B0\n1F0,1B0\n", r"^schedule: the ranks run stages \[\[0, 2\], \[1\]\]; meshpar places stages in "
                                   r"a loop"),
    ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", r"^schedule: the ranks run stages \[\[0, 1\], \[2, 3\]\]"),
    ("0F0,3F0,3B0,0B0\n", r"without stage 1; expected stages 0 \.\. S-1"),
    ("0F0,0F0,0B0\n", r"^schedule: line 1, column 2 runs 0F0 again, first run at line 1, column 1"),
    ("0F0,0F1,0B0\n", r"^schedule: no action 0B1: each stage runs F and B of every micro-batch 0 \.\. 1 once"),
    ("0F0,0I0\n", r"^schedule: no action 0W0: each stage runs F, I and W"),
    ("0F0,0B0\n\n", r"^schedule: line 2 \(rank 1\) runs no compute action"),
    ("", r"^schedule: the CSV has no lines"),
])
def test_bad_csv_input_is_named(text, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule_csv(text, "bad")


@pytest.mark.parametrize("text,cycle", [
    # Mesh 0 runs stage 0's backward before the forward it needs: a cycle on one mesh.
    ("0B0,0F0\n", "0B0 (rank 0, line 1, column 1) -sequence-> 0F0 (rank 0, line 1, column 2) -data-> "
                  "0B0 (rank 0, line 1, column 1)"),
    # Mesh 1 waits for B1.0 before F1.0 runs: mesh 0's backward waits on mesh 1, which waits on
    # mesh 0's forward of micro-batch 1, queued behind that backward.
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "0F1 (rank 0, line 1, column 3)"),
    # A whole backward among split ones is its input and weight pass, each named as a pass of it:
    # 0B1's input pass waits for 0F1, written after it.
    ("0F0,0I0,0W0,0B1,0F1\n1F0,1I0,1W0,1F1,1I1,1W1\n",
     "0I1 of 0B1 (rank 0, line 1, column 4) -data-> 0W1 of 0B1 (rank 0, line 1, column 4) -sequence-> "
     "0F1 (rank 0, line 1, column 5) -data-> 0I1 of 0B1 (rank 0, line 1, column 4)"),
])
def test_an_order_that_deadlocks_names_a_task_of_the_cycle(text, cycle, tmp_path):
    with pytest.raises(ValueError, match=r"^schedule: the order of 'bad' deadlocks on the cycle .*"
                                         + cycle.replace("(", r"\(").replace(")", r"\)")):
        parse_schedule_csv(text, "bad")
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"deadlocks.*\\(in {path}\\)$"):
        load_schedule_csv(path)


# An action as the deadlock error names it: stage, type, micro-batch, rank, line, column.
_NAMED_ACTION = re.compile(r"(\d+)([FBIW])(\d+) \(rank (\d+), line (\d+), column (\d+)\)")


def _waits_for(later, earlier, why):
    """Whether CSV action ``later`` waits for ``earlier`` (each ``((stage, type, micro-batch),
    (line, column))``) on a chain of stages, by ``why``: ``sequence``, written after it in the
    same line; ``data``, reading its result (a forward the previous stage's forward; a backward
    its own stage's forward or the next stage's backward), of the same micro-batch."""
    ((sa, ka, ma), (la, ca)), ((sb, kb, mb), (lb, cb)) = earlier, later
    if why == "sequence":
        return la == lb and ca < cb
    return why == "data" and ma == mb and (kb, ka, sa) in {("F", "F", sb - 1), ("B", "F", sb), ("B", "B", sb + 1)}


def test_a_deadlock_across_ranks_is_named_in_the_csvs_own_actions_and_cells():
    """The cycle is named as the CSV is written (torch's ``<stage><type><micro-batch>`` and each
    action's rank, line and column), never as meshpar's internal ``F0.1`` tasks; every named
    action is in the CSV where the error says, and each waits for the one before it as labelled."""
    text = "0F0,0F1,0B1,0B0\n1F0,1B0,1F1,1B1\n2F1,2B1,2F0,2B0\n"
    lines = [line.split(",") for line in text.splitlines()]
    with pytest.raises(ValueError) as error:
        parse_schedule_csv(text, "bad")
    message = str(error.value)
    prefix = "schedule: the order of 'bad' deadlocks on the cycle "
    assert message.startswith(prefix)
    assert not re.search(r"\b[FBIWAG]\d+\.\d+\b", message), message
    cycle = message[len(prefix):message.index(", each task")]
    named = [((int(m[1]), m[2], int(m[3])), (int(m[5]), int(m[6]))) for m in _NAMED_ACTION.finditer(cycle)]
    assert all(int(m[4]) == int(m[5]) - 1 for m in _NAMED_ACTION.finditer(cycle)), cycle
    whys = re.findall(r" -(\w+)-> ", cycle)
    assert len(named) == len(whys) + 1 >= 3 and named[0] == named[-1], cycle
    for (stage, kind, micro_batch), (line, column) in named:
        assert lines[line - 1][column - 1] == f"{stage}{kind}{micro_batch}", (stage, kind, micro_batch, line, column)
    for earlier, later, why in zip(named, named[1:], whys):
        assert _waits_for(later, earlier, why), (earlier, why, later)
    # The cycle crosses ranks: one line's action waits on another line's.
    assert len({line for _, (line, _) in named}) > 1


def test_a_loaded_order_runs_at_its_own_size_only():
    kind = parse_schedule_csv(ONE_F_ONE_B, "mine")
    check_stage_placement(kind, 2, 2, 2)
    with pytest.raises(ValueError, match=r"^num_micro_batches: schedule 'mine' is an order for 2 stages on 2 meshes "
                                         r"over 2 micro-batches; got num_micro_batches=4$"):
        check_stage_placement(kind, 2, 2, 4)
    with pytest.raises(ValueError, match=r"^num_stages, num_meshes: .*got num_stages=4, num_meshes=4$"):
        make_schedule(kind, 4, 2, _chain(4))
    interleaved = load_schedule_csv(ARTIFACTS / "interleaved_zb_2rank_2stagep_8mb.csv")
    with pytest.raises(ValueError, match=r"^num_meshes: .*got num_meshes=4; pass stages_per_mesh=2$"):
        check_stage_placement(interleaved, 4, 4, 8)


def test_weight_delaying_splits_a_loaded_order_of_whole_backwards_only():
    whole = parse_schedule_csv(ONE_F_ONE_B, "whole")
    delayed = make_schedule(whole, 2, 2, [(0, 1)], weight_delays=(1, 1))
    assert delayed.sequences == make_schedule("1f1b", 2, 2, [(0, 1)], weight_delays=(1, 1)).sequences
    split = parse_schedule_csv("0F0,0I0,0W0\n", "split")
    with pytest.raises(ValueError, match="^weight_delay: split places its weight passes itself"):
        make_schedule(split, 1, 1, [], weight_delays=(1,))


# Looped GPipe (torch's ScheduleLoopedBFS): no built-in schedule runs this order.
LOOPED_GPIPE = "0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1F0,1F1,3F0,3F1,3B0,3B1,1B0,1B1\n"


def test_pipeshard_parallel_takes_a_loaded_order_and_checks_it_when_made():
    kind = parse_schedule_csv(LOOPED_GPIPE, "looped_gpipe")
    meshpar.PipeshardParallel(schedule=kind, num_stages=4, stages_per_mesh=2, num_micro_batches=2)
    with pytest.raises(ValueError, match=r"^num_micro_batches: schedule 'looped_gpipe' is an order for 4 stages on "
                                         r"2 meshes over 2 micro-batches; got num_micro_batches=4"):
        meshpar.PipeshardParallel(schedule=kind, num_stages=4, stages_per_mesh=2, num_micro_batches=4)
    with pytest.raises(ValueError, match=r"^num_meshes: .*got num_meshes=4; pass stages_per_mesh=2$"):
        meshpar.PipeshardParallel(schedule=kind, num_stages=4, num_micro_batches=2)
    with pytest.raises(ValueError, match=r"^schedule: 'looped_gpipe' is an order of one size \(loaded from CSV\), "
                                         r"but 'auto' plans"):
        meshpar.PipeshardParallel(schedule=kind, num_stages="auto")
    split = parse_schedule_csv("0F0,0F1,2F0,2F1,2I0,2W0,2I1,2W1,0I0,0W0,0I1,0W1\n"
                               "1F0,1F1,3F0,3F1,3I0,3W0,3I1,3W1,1I0,1W0,1I1,1W1\n", "split")
    with pytest.raises(ValueError, match="^weight_delay: split always splits backwards and places the weight passes"):
        meshpar.PipeshardParallel(schedule=split, num_stages=4, stages_per_mesh=2, num_micro_batches=2,
                                  weight_delay=True)
    with pytest.raises(ValueError, match=r"^schedule: unknown 'order\.csv'; .*meshpar\.load_schedule_csv\(path\)$"):
        meshpar.PipeshardParallel(schedule="order.csv")


def test_a_pipeline_on_a_loaded_order_matches_jit(tmp_path):
    """The looped GPipe order from a CSV file, four MLP stages on two meshes: two training steps
    equal jax.jit's, run in the file's order."""
    path = tmp_path / "looped_gpipe.csv"
    path.write_text(LOOPED_GPIPE)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32),
             "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(MLP(features=(16,) * 7 + (4,), num_stages=4), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=4, stages_per_mesh=2,
                                       stage_mesh_shape=(4, 1), schedule=meshpar.load_schedule_csv(path))
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    schedule = parallel.get_compiled(par_state, batch).schedule
    assert schedule.name == "looped_gpipe" and schedule.stage_mesh == (0, 1, 0, 1)
    assert format_schedule_csv(schedule.sequences) == LOOPED_GPIPE


def test_saving_something_that_is_no_schedule_names_the_argument(tmp_path):
    with pytest.raises(TypeError, match="schedule: expected a PipelineSchedule"):
        meshpar.save_schedule_csv("1f1b", tmp_path / "order.csv")
