"""The deadlock-freedom verifier (passes/pipeline/lowering/launch_sequences): per process, the
programs it launches on each mesh and the cross-process transfers it numbers, from the compiled
IR alone. The 8 CPU devices of one process stand for 2 or 4 processes (``process_of``), so the
real compiled programs of layouts whose meshes span processes are checked without starting any."""

import dataclasses
import re

import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.lowering.launch_sequences import launch_sequences, verify_launch_sequences
from meshpar.passes.program.launches import ProgramLaunch
from meshpar.passes.program.step_instructions import RunPipeline, StepInstruction
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import make_state, mse


def _compiled(num_stages=2, **options):
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(MLP(features=(16,) * (num_stages - 1) + (4,), num_stages=num_stages), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=num_stages, **options))
    return parallel.get_compiled(state, batch)


def _two_per_process(device):
    return device.id // 2


def _four_per_process(device):
    return device.id // 4


def _sequences(compiled, process_of):
    return launch_sequences(compiled.step, compiled.program, compiled.moves, compiled.meshes, process_of)


CONFIGS = {
    # Each mesh (2 x 2) spans two processes along its data axis; replicas reduce once per step.
    "data replicas, p2p": dict(stage_mesh_shape=(2, 2), executor="p2p", gradient_reduction="per_step"),
    "zb_v, p2p": dict(num_stages=4, stages_per_mesh=2, stage_mesh_shape=(4, 1), schedule="zb_v", executor="p2p"),
    "collective moves": dict(stage_mesh_shape=(2, 2), executor="collective"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request):
    return _compiled(**CONFIGS[request.param])


def test_the_compiled_programs_are_accepted_as_several_processes(compiled):
    # The compiler ran the verifier for the real (one) process already.
    assert compiled.launches is not None and all(len(ps) == 1 for ps in compiled.launches.mesh_processes)
    for process_of, count in ((_two_per_process, 4), (_four_per_process, 2)):
        seqs = _sequences(compiled, process_of)
        verify_launch_sequences(seqs)
        assert len(seqs.processes) == count
        spanning = [m for m, ps in enumerate(seqs.mesh_processes) if len(ps) > 1]
        assert spanning == ([0, 1] if count == 4 else [])
        for m in spanning:
            # Every pipeline instruction launching a program on the mesh is listed, in launch order.
            launched = [str(ins) for mesh, ins in compiled.program.launch_sequence()
                        if mesh == m and not ins.sends and (ins.tasks or ins.reduces)]
            got = seqs.processes[seqs.mesh_processes[m][0]].collectives[m]
            assert [w for w in got if w in launched] == launched
        if count == 2:
            continue
        reduces = [str(ins) for _, ins in compiled.program.launch_sequence() if ins.reduces]
        collective = compiled.moves.moves[0].key.kind.value == "collective"
        if compiled.gradients.reduced_stages():
            assert reduces and all(r in seqs.processes[0].collectives[0] + seqs.processes[2].collectives[1]
                                   for r in reduces)
        if collective:
            # A collective move is one program over both meshes: on both meshes' lists, no transfer.
            sends = [str(ins) for _, ins in compiled.program.launch_sequence() if ins.sends]
            assert sends and all(s in seqs.processes[0].collectives[0] and s in seqs.processes[2].collectives[1]
                                 for s in sends)
        else:
            # Every process numbers every cross-process hop of the p2p moves, in one order.
            hops = seqs.processes[0].transfers
            assert hops and all(ps.transfers == hops for ps in seqs.processes)
            assert any(t.src != t.dst and "send of" in t.what for t in hops)


def test_one_process_swapping_two_launches_on_a_mesh_is_refused():
    compiled = _compiled(**CONFIGS["data replicas, p2p"])
    seqs = _sequences(compiled, _two_per_process)
    mesh = 1
    first, peer = seqs.mesh_processes[mesh]
    launches = list(seqs.processes[peer].collectives[mesh])
    reduction = next(k for k, w in enumerate(launches) if w.startswith("gradient reduction"))
    launches[reduction - 1], launches[reduction] = launches[reduction], launches[reduction - 1]
    collectives = list(seqs.processes[peer].collectives)
    collectives[mesh] = tuple(launches)
    processes = list(seqs.processes)
    processes[peer] = dataclasses.replace(processes[peer], collectives=tuple(collectives))
    want, got = seqs.processes[first].collectives[mesh][reduction - 1], launches[reduction - 1]
    with pytest.raises(PlanVerificationError, match=re.escape(
            f"mesh {mesh} (processes {first}, {peer}): processes {first} and {peer} launch its programs in "
            f"different orders, which deadlocks its collectives; launch #{reduction - 1} is '{want}' on process "
            f"{first} but '{got}' on process {peer}")):
        verify_launch_sequences(dataclasses.replace(seqs, processes=tuple(processes)))
    assert got.startswith("gradient reduction") and not want.startswith("gradient reduction")


def test_a_receiver_numbering_two_transfers_the_other_way_round_is_refused():
    compiled = _compiled(**CONFIGS["zb_v, p2p"])
    seqs = _sequences(compiled, _two_per_process)
    hops = seqs.processes[0].transfers
    # The receiver numbers the first transfer of one move (an activation of micro-batch 0) and a
    # later one from the same sender, of another move, the other way round.
    n = 0
    sender, receiver = hops[n].src, hops[n].dst
    j = next(k for k, t in enumerate(hops) if (t.src, t.dst) == (sender, receiver)
             and t.what.split(":")[0] != hops[n].what.split(":")[0])
    swapped = list(hops)
    swapped[n], swapped[j] = swapped[j], swapped[n]
    processes = list(seqs.processes)
    processes[receiver] = dataclasses.replace(processes[receiver], transfers=tuple(swapped))
    with pytest.raises(PlanVerificationError, match=re.escape(
            f"transfers from process {sender} to process {receiver} are numbered differently on the two processes, "
            f"which pairs the wrong values or hangs: transfer #{n} is '{hops[n]}' on process {sender} (sender) "
            f"but '{hops[j]}' on process {receiver} (receiver)")):
        verify_launch_sequences(dataclasses.replace(seqs, processes=tuple(processes)))


def test_a_transfer_its_receiver_never_numbers_is_refused():
    compiled = _compiled(**CONFIGS["data replicas, p2p"])
    seqs = _sequences(compiled, _two_per_process)
    hops = seqs.processes[0].transfers
    last = hops[-1]
    processes = list(seqs.processes)
    processes[last.dst] = dataclasses.replace(processes[last.dst], transfers=hops[:-1])
    with pytest.raises(PlanVerificationError, match=re.escape(
            f"transfer #{len(hops) - 1} is '{last}' on process {last.src} (sender) but nothing (its list has ended) "
            f"on process {last.dst} (receiver)")):
        verify_launch_sequences(dataclasses.replace(seqs, processes=tuple(processes)))


@dataclasses.dataclass(frozen=True)
class _Probe(StepInstruction):
    """A toy step instruction from this file alone: one program on a mesh, listed by its own launches."""

    mesh: int
    reads = property(lambda self: ())
    writes = property(lambda self: ())
    launches = property(lambda self: (ProgramLaunch(self.mesh, str(self)),))

    def __str__(self) -> str:
        return f"probe on mesh {self.mesh}"


def test_an_instruction_from_a_test_file_is_listed_by_its_own_launches():
    compiled = _compiled(**CONFIGS["data replicas, p2p"])
    instructions = list(compiled.step.instructions)
    at = next(k for k, ins in enumerate(instructions) if isinstance(ins, RunPipeline))
    probed = dataclasses.replace(compiled.step, instructions=tuple(instructions[:at] + [_Probe(1)] + instructions[at:]))
    seqs = launch_sequences(probed, compiled.program, compiled.moves, compiled.meshes, _two_per_process)
    verify_launch_sequences(seqs)
    before = _sequences(compiled, _two_per_process)
    for p in seqs.mesh_processes[1]:
        got, was = seqs.processes[p].collectives[1], before.processes[p].collectives[1]
        # Before every pipeline launch on its mesh, after what precedes the pipeline there.
        k = got.index("probe on mesh 1")
        assert got[:k] + got[k + 1:] == was and "probe on mesh 1" not in seqs.processes[p].collectives[0]
        first_pipeline = next(str(ins) for mesh, ins in compiled.program.launch_sequence()
                              if mesh == 1 and not ins.sends and (ins.tasks or ins.reduces))
        assert k < got.index(first_pipeline)
