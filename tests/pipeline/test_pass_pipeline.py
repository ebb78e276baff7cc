"""The compiler as one declared list of passes (``passes.pipeline_driver.PIPELINE_PASSES``):
each a name, a function over the typed ``CompileState`` and its verifier, run in order by
``run_passes``; the IR after any pass is kept and shown (``CompiledPipeline.ir_after``)."""

import dataclasses

import jax
import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline_driver import PIPELINE_PASSES, CompileState, Pass, run_passes
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import make_state, mse


@pytest.fixture(scope="module")
def compiled():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(MLP(features=(16, 4), num_stages=2), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, schedule="1f1b"))
    return parallel.get_compiled(state, batch)


def _state_after(compiled, name: str) -> CompileState:
    return dict(compiled.passes)[name]


def _rest(name: str) -> list[Pass]:
    names = [p.name for p in PIPELINE_PASSES]
    return list(PIPELINE_PASSES[names.index(name) + 1:])


def test_passes_run_in_the_declared_order(compiled):
    declared = [p.name for p in PIPELINE_PASSES]
    ran = list(compiled.pass_names)
    assert ran == [n for n in declared if n in ran], "the passes ran out of their declared order"
    # A train step of unstacked parameters with one program per pass: the optional passes stay out.
    assert {"forward_operands", "stacked_arrays", "fuse_compute_runs"}.isdisjoint(ran)
    assert {"split_stages", "place_stages", "plan_moves", "make_schedule", "lower_to_program", "lower_step",
            "launch_sequences", "stage_kernels"} <= set(ran)


def test_an_observer_sees_the_state_its_pass_returned_and_a_bad_one_is_refused(compiled):
    start = _state_after(compiled, "layout_step")
    rest = _rest("layout_step")
    seen = []
    final, ran = run_passes(start, rest, observers={"lower_step": seen.append})
    assert len(seen) == 1 and seen[0] is dict(ran)["lower_step"]
    assert seen[0].program is None, "lower_step ran after the pipeline was planned"
    with pytest.raises(ValueError, match="observers: 'no_such_pass'"):
        run_passes(start, rest, observers={"no_such_pass": seen.append})
    with pytest.raises(ValueError, match="observers: 'lower_step'"):
        run_passes(start, rest, observers={"lower_step": "not a function"})


def test_each_pass_sets_what_it_says_it_makes(compiled):
    states = dict(compiled.passes)
    previous = None
    for name in compiled.pass_names:
        (made,) = [p.makes for p in PIPELINE_PASSES if p.name == name]
        state = states[name]
        if previous is not None:
            changed = {f.name for f in dataclasses.fields(CompileState)
                       if getattr(state, f.name) is not getattr(previous, f.name)}
            assert changed <= set(made), f"{name} changed {sorted(changed - set(made))}, which it does not declare"
        previous = state
    last = compiled.passes[-1][1]
    for field in ("loss", "graph", "placed", "split", "layout", "parts", "gradients", "transfers", "moves",
                  "durations", "schedule", "program", "step", "launches", "kernels"):
        assert getattr(last, field) is not None, f"no pass set {field}"


def test_the_result_is_the_last_passes_ir(compiled):
    last = compiled.passes[-1][1]
    assert compiled.program is last.program and compiled.step is last.step and compiled.kernels is last.kernels
    assert compiled.graph is _state_after(compiled, "split_stages").graph


def test_ir_after_a_pass_shows_what_it_made(compiled):
    text = compiled.ir_after("make_schedule")
    assert text.startswith("// -----// IR after make_schedule: schedule //----- //")
    assert str(compiled.schedule) in text
    graph_text = compiled.ir_after("split_stages")
    assert "IR after split_stages: graph" in graph_text and str(compiled.graph) in graph_text
    durations = compiled.ir_after("estimate_durations")
    assert "durations //" in durations and "delays //" in durations


def test_ir_after_a_pass_that_did_not_run_names_those_that_did(compiled):
    with pytest.raises(ValueError, match=r"name: expected a pass that ran for this step, one of \[.*'plan_moves'"):
        compiled.ir_after("fuse_compute_runs")


def test_a_verifier_failure_names_the_pass(compiled):
    def negative_delays(state: CompileState) -> CompileState:
        made = {p.name: p for p in PIPELINE_PASSES}["estimate_durations"].run(state)
        return dataclasses.replace(made, delays=tuple(-1 for _ in state.placed.meshes))

    passes = [dataclasses.replace(p, run=negative_delays) if p.name == "estimate_durations" else p
              for p in _rest("plan_moves")]
    with pytest.raises(PlanVerificationError, match=r"after pass estimate_durations: weight delays \(-1, -1\)"):
        run_passes(_state_after(compiled, "plan_moves"), passes)


def test_a_pass_from_a_test_file_runs_in_the_list(compiled):
    """A new pass is one ``Pass`` in a list: here, one that keeps only every other mesh's
    instructions of the lowered program, which the program verifier then refuses."""
    def drop_mesh(state: CompileState) -> CompileState:
        program = state.program
        return dataclasses.replace(state, program=dataclasses.replace(
            program, instructions=(program.instructions[0], ()) + tuple(program.instructions[2:])))

    from meshpar.passes.pipeline.lowering.pipeline_program import verify_pipeline_program

    toy = Pass("drop_second_mesh", drop_mesh, lambda st: verify_pipeline_program(st.program, st.reduced), ("program",))
    rest = _rest("lower_to_program")
    with pytest.raises(PlanVerificationError, match="after pass drop_second_mesh: "):
        run_passes(_state_after(compiled, "lower_to_program"), [toy, *rest])
    # Without it, the same rest of the list makes the same programs again.
    state, ran = run_passes(_state_after(compiled, "lower_to_program"), rest)
    assert [name for name, _ in ran] == [p.name for p in rest if p.name in compiled.pass_names]
    assert state.program == compiled.program and state.step == compiled.step


def test_the_module_doc_lists_every_pass():
    from meshpar.passes import pipeline_driver

    missing = [p.name for p in PIPELINE_PASSES if f"``{p.name}``" not in pipeline_driver.__doc__]
    assert not missing, f"the driver's module doc does not list {missing}"


def test_deep_verification_type_checks_whole_jaxprs_only_when_asked(monkeypatch):
    from meshpar.passes import jax_ir
    from meshpar.passes.verification import deep_verification, type_check

    good = jax.make_jaxpr(lambda x: jax.numpy.sin(x) * 2.0)(1.0).jaxpr
    # Its equations read an input the jaxpr no longer binds.
    broken = jax_ir.Jaxpr(good.constvars, [], good.outvars, good.eqns)
    monkeypatch.setenv("MESHPAR_VERIFY", "full")
    assert deep_verification()
    type_check(good, "the good one")
    with pytest.raises(PlanVerificationError, match="the broken one does not type-check"):
        type_check(broken, "the broken one")
    monkeypatch.delenv("MESHPAR_VERIFY")
    assert not deep_verification()
    type_check(broken, "the broken one")
    monkeypatch.setenv("MESHPAR_VERIFY", "everything")
    with pytest.raises(ValueError, match=r"MESHPAR_VERIFY: expected one of \('invariants', 'full'\), got 'everything'"):
        deep_verification()
