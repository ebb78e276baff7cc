"""ZB-V and DualPipeV run on the V placement (2P stages on P meshes, stages r and 2P-1-r on mesh
r) and equal the same step under jax.jit on one device, in one process with 8 devices."""

import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from examples.u_transformer import UTransformer, ut_batch, ut_loss
from meshpar.passes.program.moves import TransferKind
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES
from pipeline_models import assert_trees_close, make_state, run_both

V_SCHEDULES = ("zb_v", "dualpipev")


def _method(schedule, num_meshes, num_micro_batches, **options):
    return meshpar.PipeshardParallel(
        num_micro_batches=num_micro_batches, num_stages=2 * num_meshes, stages_per_mesh=2,
        stage_mesh_shape=(8 // num_meshes, 1), schedule=schedule, **options)


def _model(name, num_stages):
    if name == "gpt":
        return GPT(num_stages=num_stages), gpt_batch(0, 32, 8, 64), gpt_loss
    return UTransformer(num_stages=num_stages), ut_batch(0, 32), ut_loss


CI = {("zb_v", "gpt", 2, 2)}


@pytest.mark.parametrize("schedule,name,num_meshes,rounds", [
    pytest.param(s, n, p, r, marks=() if (s, n, p, r) in CI else pytest.mark.slow)
    for s in V_SCHEDULES for n in ("gpt", "ut") for p in (2, 4) for r in (2, 4)])
def test_v_schedules_match_jit(schedule, name, num_meshes, rounds):
    """P in {2, 4} meshes, M in {2P, 4P}: two steps equal jax.jit's (loss and parameters); the
    V places stage r and 2P-1-r on mesh r, and the turn of the V (stages P-1 and P, on the
    last mesh) moves nothing."""
    P, M = num_meshes, rounds * num_meshes
    model, batch, loss = _model(name, 2 * P)
    state = make_state(model, batch["x"][:1])
    ref_state, par_state, parallel = run_both(supervised_step(loss), state, batch, _method(schedule, P, M), 2)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    executable = parallel.get_executable(par_state, batch)
    assert executable.program.stage_mesh == tuple(s if s < P else 2 * P - 1 - s for s in range(2 * P))
    turn = [t for t in executable.program.transfers if {t.src_stage, t.dst_stage} == {P - 1, P}]
    assert turn and all(t.kind is TransferKind.LOCAL for t in turn)
    # The runtime held the residuals the schedule's order keeps alive, stage by stage.
    assert executable.peak_live_activations == [SCHEDULES[schedule].peak_live(s, 2 * P, M, P) for s in range(2 * P)]
    assert "mesh 0: stages [0, " in executable.describe()


def _mesh_peaks(schedule):
    """Per mesh, the most micro-batches' residuals held at once over both its stages, along its
    sequence (a forward opens one, an input pass closes one)."""
    peaks = []
    for seq in schedule.sequences:
        held = peak = 0
        for t in seq:
            held += {"F": 1, "I": -1, "B": -1}.get(t.kind.value, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.slow
def test_zb_v_holds_what_1f1b_holds_and_dualpipev_one_more(tmp_path):
    """ZB-V keeps 2P micro-batches of a half-depth stage alive per mesh, what 1F1B keeps of a
    whole one (P): the runtime's live activation bytes on the first mesh come out alike.
    DualPipeV keeps one more, DualPipe's README's PP + 1 for PP = 2P stages."""
    P, M = 2, 8
    batch = gpt_batch(0, 32, 8, 64)
    activations, executables, schedules = {}, {}, {}
    for schedule, stages in (("zb_v", 2 * P), ("dualpipev", 2 * P), ("1f1b", P)):
        state = make_state(GPT(num_stages=stages), batch["x"][:1])
        method = (_method(schedule, P, M) if stages == 2 * P else meshpar.PipeshardParallel(
            num_micro_batches=M, num_stages=P, stage_mesh_shape=(8 // P, 1), schedule=schedule))
        step = meshpar.parallelize(supervised_step(gpt_loss), method=method)
        step(state, batch)
        _, trace = step.trace(str(tmp_path / f"{schedule}.json"), state, batch)
        executables[schedule] = ex = step.get_executable(state, batch)
        schedules[schedule] = step.get_compiled(state, batch).schedule
        activations[schedule] = max(trace.live_bytes.activations[d] for d in ex.mesh_devices[0])
        assert ex.peak_live_activations == [SCHEDULES[schedule].peak_live(s, stages, M, P) for s in range(stages)]
    assert _mesh_peaks(schedules["zb_v"]) == [2 * P] * P
    assert _mesh_peaks(schedules["1f1b"]) == [P, P - 1]
    assert max(_mesh_peaks(schedules["dualpipev"])) == 2 * P + 1
    assert activations["zb_v"] == pytest.approx(activations["1f1b"], rel=0.2), activations


@pytest.mark.parametrize("options, match", [
    (dict(schedule="zb_v", num_stages=4, stages_per_mesh=2, num_micro_batches=2), "num_micro_batches"),
    (dict(schedule="dualpipev", num_stages=4, num_micro_batches=4), "stages_per_mesh"),
    (dict(schedule="zb_v", num_stages=6, stages_per_mesh=3, num_micro_batches=8), "stages_per_mesh"),
])
def test_bad_v_options_are_named_before_tracing(options, match):
    batch = gpt_batch(0, 32, 8, 64)
    state = make_state(GPT(num_stages=4), batch["x"][:1])

    def step(state, batch):
        raise AssertionError("traced: the check must come first")

    with pytest.raises(ValueError, match=match):  # as the options are made, before any call
        meshpar.parallelize(step, method=meshpar.PipeshardParallel(stage_mesh_shape=(2, 1), **options))(state, batch)
