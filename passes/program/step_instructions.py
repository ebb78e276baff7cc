"""The step program: the instructions every process runs around the pipeline, in order."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from jax.sharding import NamedSharding

from .. import jax_ir
from .batch_rows import GlobalBatchFeed, GlobalBatchPlacement
from .launches import DeviceCopy, Launch, MoveLaunch, PipelineLaunches, ProgramLaunch
from .moves import ValueMove
from .pipeline_instructions import BufferId, PipelineProgram
from .shardings import PlaceLeaf
from .stacked_leaves import GatheredArray, LeafPieces, StackedArray
from .step_values import AuxReduction, OuterKind, OuterRef

__all__ = ["AssembleOutputs", "AwaitArrivals", "CombineMicroBatches", "FeedConstant", "FeedInstruction", "FeedValue",
           "FetchParameter", "FoldKey", "FreeValues", "JoinStackedLeaves", "Located", "MoveMicroBatches", "OutputSource",
           "PlaceInputs", "ReduceGradient", "RunCompute", "RunMove", "RunPipeline", "SHARE_MAX_BYTES", "SharedOutput", "ShareOutputs",
           "SliceMicroBatches", "SplitStackedLeaves", "StepInstruction", "StepProgram"]


# A value of the step on one mesh: what a step instruction reads there or makes there.
Located = tuple[OuterRef, int]


class StepInstruction(abc.ABC):
    """What an instruction of the step program says about itself, so that the verifier (and
    ``program_text``) reads every kind without a list of kinds: the values it reads and makes,
    each on its mesh, the loss or aux values it combines, the parameter gradients it reduces,
    the stage operands it feeds, the values it frees, and its own wiring against the pipeline program. Inputs and constants
    (``OuterKind.IN``, ``OuterKind.CONST``) are readable anywhere; every other value it reads on
    a mesh must have been made there by an earlier instruction. A new kind is this class's
    subclass and one handler in the runtime (``runtime.step_handlers.register_step_handler``)."""

    @property
    @abc.abstractmethod
    def reads(self) -> tuple[Located, ...]:
        """``(value, mesh)`` of every value it reads, on the mesh it reads it on."""

    @property
    @abc.abstractmethod
    def writes(self) -> tuple[Located, ...]:
        """``(value, mesh)`` of every value it makes (a move: on its destination mesh)."""

    @property
    def frees(self) -> tuple[Located, ...]:
        """``(value, mesh)`` of every value it drops once it has run: nothing reads or makes it
        later in the step (``lowering.step_frees``)."""
        return ()

    @property
    def launches(self) -> tuple[Launch, ...]:
        """What it launches that processes must launch alike, in order (``program.launches``): its
        programs on meshes that may span processes, its planned moves, its copies between
        devices. Helper programs that keep each device's data where it is (slices, folded keys)
        are left out (``lowering.launch_sequences``)."""
        return ()

    @property
    def combines(self) -> tuple[OuterRef, ...]:
        """The loss or aux values whose micro-batches it combines (each once per step)."""
        return ()

    @property
    def reduces(self) -> tuple[tuple[int, int], ...]:
        """``(stage, parameter)`` of each stage's accumulated gradient it reduces (each once)."""
        return ()

    @property
    def feeds(self) -> tuple[tuple[int, int], ...]:
        """``(stage, position)`` of each stage operand it feeds for the pipeline (each once)."""
        return ()

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        """Why it is wired wrongly against ``program`` (the mesh it runs on, the buffers it
        reads) and the parameters' owners (``param_owner[k]``: the stage owning parameter
        ``k``), or ``None``."""
        return None


def _names(refs: Iterable[Any], most: int = 4) -> str:
    """At most ``most`` of ``refs`` by name, then how many more: an instruction's line stays short."""
    refs = list(refs)
    shown = ", ".join(map(str, refs[:most]))
    return shown if len(refs) <= most else f"{shown} and {len(refs) - most} more"


@dataclasses.dataclass(frozen=True)
class SplitStackedLeaves(StepInstruction):
    """The user's stacked leaves as the per-stage pieces the rewritten step takes
    (``stacked_leaves``): each held leaf as views of its shards, each gathered one cut on its
    home mesh and moved by ``GatheredArray.into``."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    # The user's leaves in, the step's input leaves out: no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(MoveLaunch(mv.move_key, f"{self}: piece {p} of leaf {i}")
                     for i, gathered in self.gathered for p, mv in enumerate(gathered.into) if mv is not None)

    def __str__(self) -> str:
        return f"split {len(self.held) + len(self.gathered)} stacked leaves into their pieces"


@dataclasses.dataclass(frozen=True)
class PlaceInputs(StepInstruction):
    """Every input leaf (of the rewritten step) placed as ``placements`` says; a leaf of
    ``global_batches`` (a global batch array read whole around the pipeline) by its planned
    moves, every process joining each, in this order."""

    placements: tuple[PlaceLeaf, ...]
    global_batches: tuple[GlobalBatchPlacement, ...] = ()

    # Inputs are readable anywhere (``StepInstruction``): placing them makes no other value.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        if any(p.placement != self.placements[p.leaf] for p in self.global_batches):
            return "moves a global batch leaf elsewhere than its placement"
        return None

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(MoveLaunch(key, f"{self}: batch leaf {placed.leaf}, move {n}")
                     for placed in sorted(self.global_batches, key=lambda b: b.leaf)
                     for n, key in enumerate(placed.moves))

    def __str__(self) -> str:
        moved = f", {len(self.global_batches)} global batch leaves by their moves" if self.global_batches else ""
        return f"place {len(self.placements)} input leaves{moved}"


@dataclasses.dataclass(frozen=True)
class RunCompute(StepInstruction):
    """``jaxpr(*inputs) -> outputs`` on mesh ``mesh``; output ``k`` constrained to
    ``output_shardings[k]`` (``None``: as XLA lays it out)."""

    mesh: int
    jaxpr: jax_ir.ClosedJaxpr
    inputs: tuple[OuterRef, ...]
    outputs: tuple[OuterRef, ...]
    output_shardings: tuple[NamedSharding | None, ...]

    reads = property(lambda self: tuple((r, self.mesh) for r in self.inputs))
    writes = property(lambda self: tuple((r, self.mesh) for r in self.outputs))

    launches = property(lambda self: (ProgramLaunch(self.mesh, str(self)),))

    def __str__(self) -> str:
        # Never the jaxpr: a line stays short.
        return f"compute of {_names(self.outputs)} on mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class RunMove(StepInstruction):
    """``values`` cross from mesh ``src`` to mesh ``dst`` by ``via``; several values travel packed
    into one vector and are unpacked on ``dst``, value ``k`` laid out as ``unpacked[k]``."""

    values: tuple[OuterRef, ...]
    src: int
    dst: int
    via: ValueMove
    unpacked: tuple[NamedSharding, ...] = ()

    reads = property(lambda self: tuple((r, self.src) for r in self.values))
    writes = property(lambda self: tuple((r, self.dst) for r in self.values))

    @property
    def launches(self) -> tuple[Launch, ...]:
        move = MoveLaunch(self.via.move_key, str(self))
        if not self.unpacked:
            return (move,)
        return (ProgramLaunch(self.src, f"packing for the {self}"), move,
                ProgramLaunch(self.dst, f"unpacking of the {self}"))

    def __str__(self) -> str:
        return f"move of {_names(self.values)} from mesh {self.src} to mesh {self.dst}"


class FeedInstruction(StepInstruction):
    """Feeds operand ``position`` of stage ``stage`` (a ``stage_kernel.KernelOperand``) for the
    pipeline: one value every micro-batch reads or, with ``per_micro_batch``, one value per
    micro-batch. Every stage operand is fed by exactly one such instruction, before the
    pipeline runs. A feed that moves values runs on every process; the others only where the
    stage is."""

    stage: int
    position: int
    per_micro_batch: ClassVar[bool] = False

    writes = property(lambda self: ())
    feeds = property(lambda self: ((self.stage, self.position),))

    def _on_stage_mesh(self, program: PipelineProgram, mesh: int) -> str | None:
        if mesh != program.stage_mesh[self.stage]:
            return f"reads on mesh {mesh}, but stage {self.stage} runs on mesh {program.stage_mesh[self.stage]}"
        return None


@dataclasses.dataclass(frozen=True)
class FetchParameter(FeedInstruction):
    """Input leaf ``leaf`` (a parameter another stage owns), as placed on mesh ``owner``, moved
    by ``via`` to the stage's mesh."""

    stage: int
    position: int
    leaf: int
    owner: int
    via: ValueMove

    reads = property(lambda self: ((OuterRef(OuterKind.IN, self.leaf), self.owner),))
    launches = property(lambda self: (MoveLaunch(self.via.move_key, str(self)),))

    def __str__(self) -> str:
        return f"fetch in{self.leaf} from mesh {self.owner} for stage {self.stage}'s operand {self.position}"


@dataclasses.dataclass(frozen=True)
class FeedValue(FeedInstruction):
    """``value``, placed or computed before the pipeline on the stage's mesh ``mesh``, as it is."""

    stage: int
    position: int
    value: OuterRef
    mesh: int

    reads = property(lambda self: ((self.value, self.mesh),))

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        return self._on_stage_mesh(program, self.mesh)

    def __str__(self) -> str:
        return f"feed {self.value} to stage {self.stage}'s operand {self.position}"


@dataclasses.dataclass(frozen=True)
class FeedConstant(FeedInstruction):
    """The step's constant ``const``, placed once, laid out as ``sharding``."""

    stage: int
    position: int
    const: int
    sharding: NamedSharding

    reads = property(lambda self: ())

    def __str__(self) -> str:
        return f"feed const{self.const} to stage {self.stage}'s operand {self.position}"


@dataclasses.dataclass(frozen=True)
class FoldKey(FeedInstruction):
    """The PRNG key ``key`` on mesh ``mesh`` folded with each micro-batch's index: micro-batch
    ``m`` draws from ``jax.random.fold_in(key, m)``, for ``num_micro_batches`` micro-batches."""

    stage: int
    position: int
    key: OuterRef
    mesh: int
    num_micro_batches: int
    per_micro_batch: ClassVar[bool] = True

    reads = property(lambda self: ((self.key, self.mesh),))

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        if self.num_micro_batches != program.num_micro_batches:
            return f"folds {self.num_micro_batches} keys for {program.num_micro_batches} micro-batches"
        return self._on_stage_mesh(program, self.mesh)

    def __str__(self) -> str:
        return f"fold key {self.key} per micro-batch for stage {self.stage}'s operand {self.position}"


@dataclasses.dataclass(frozen=True)
class SliceMicroBatches(FeedInstruction):
    """``value`` on mesh ``mesh`` cut along dimension 0 into ``num_micro_batches`` slices of
    ``micro_batch_size`` rows, each laid out as ``sharding``: the whole value placed once as
    ``[M, micro_batch_size, ...]`` (``stacked``), then cut by one program. ``unplaced``: a batch
    leaf the step never places whole, cut from the leaf as the caller gave it."""

    stage: int
    position: int
    value: OuterRef
    mesh: int
    sharding: NamedSharding
    stacked: NamedSharding
    num_micro_batches: int
    micro_batch_size: int
    unplaced: bool = False
    per_micro_batch: ClassVar[bool] = True

    reads = property(lambda self: () if self.unplaced else ((self.value, self.mesh),))

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        if self.num_micro_batches != program.num_micro_batches:
            return f"cuts {self.num_micro_batches} slices for {program.num_micro_batches} micro-batches"
        if self.unplaced and self.value.kind is not OuterKind.IN:
            return f"cuts {self.value} from the caller's leaf, but it is no input leaf"
        return self._on_stage_mesh(program, self.mesh)

    def __str__(self) -> str:
        return (f"slice {self.value} into {self.num_micro_batches} micro-batches of {self.micro_batch_size} rows "
                f"for stage {self.stage}'s operand {self.position}")


@dataclasses.dataclass(frozen=True)
class MoveMicroBatches(FeedInstruction):
    """Each micro-batch of a global batch leaf sent by its own move straight from where its rows
    lie to the stage (``batch``: the rows and the moves), ``micro_batch_size`` rows each."""

    batch: GlobalBatchFeed
    micro_batch_size: int
    per_micro_batch: ClassVar[bool] = True

    reads = property(lambda self: ())
    stage = property(lambda self: self.batch.stage)
    position = property(lambda self: self.batch.position)

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        if len(self.batch.rows) != program.num_micro_batches:
            return f"moves {len(self.batch.rows)} micro-batches for {program.num_micro_batches}"
        return None

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(MoveLaunch(key, f"micro-batch {m} of batch leaf {self.batch.leaf} to stage {self.stage}")
                     for m, key in enumerate(self.batch.moves))

    def __str__(self) -> str:
        return (f"move {len(self.batch.rows)} micro-batches of in{self.batch.leaf} to stage {self.stage}'s "
                f"operand {self.position}")


@dataclasses.dataclass(frozen=True)
class RunPipeline(StepInstruction):
    # The pipeline program's buffers are its own (``verify_pipeline_program``).
    reads = property(lambda self: ())
    writes = property(lambda self: ())
    launches = property(lambda self: (PipelineLaunches(),))

    def __str__(self) -> str:
        return "run the pipeline program"


@dataclasses.dataclass(frozen=True)
class CombineMicroBatches(StepInstruction):
    """``value`` (the loss or an aux value) on ``mesh``: the result buffers of every micro-batch
    combined as ``how`` says, then read as ``aval`` from its wire form and laid out as
    ``sharding`` (``None``: as combined). ``per_replica``: each buffer holds one value per
    data-parallel replica of its stage (``data_replicas``), led by the replica count, which
    combine first, as micro-batches do."""

    value: OuterRef
    buffers: tuple[BufferId, ...]
    mesh: int
    how: AuxReduction
    aval: jax_ir.AbstractValue
    sharding: NamedSharding | None
    per_replica: bool = False

    # It reads the pipeline program's result buffers, no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ((self.value, self.mesh),))
    combines = property(lambda self: (self.value,))

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        stage = self.buffers[0].index
        if self.mesh != program.stage_mesh[stage] or any(b not in program.results for b in self.buffers):
            return f"does not combine the results of stage {stage} on its mesh"
        return None

    @property
    def launches(self) -> tuple[Launch, ...]:
        combine = ProgramLaunch(self.mesh, str(self))
        if self.sharding is None:
            return (combine,)
        return (combine, ProgramLaunch(self.mesh, f"relayout of the {self}"))

    def __str__(self) -> str:
        return f"{self.how.value} of {self.value} over {len(self.buffers)} micro-batches on mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class ReduceGradient(StepInstruction):
    """Stage ``stage``'s accumulated gradient of parameter ``param`` (its ``position``-th), moved
    by ``move`` (``None``: already on the owner's mesh) into ``GRAD param`` on ``mesh``: with
    ``adds``, added to what earlier stages' reductions made there (a program reading it),
    else the gradient as it arrives. ``sharding`` is the stage's accumulator's (what another
    process names in its place). It consumes the accumulator: each is reduced once
    (``verify_step_program``), so the step holds none past its reduction."""

    param: int
    stage: int
    position: int
    mesh: int
    move: ValueMove | None
    sharding: NamedSharding
    aval: jax_ir.AbstractValue
    adds: bool = False

    # Besides the stage's accumulator, which the pipeline program leaves, it reads the gradient
    # it adds to.
    reads = property(lambda self: ((OuterRef(OuterKind.GRAD, self.param), self.mesh),) if self.adds else ())
    writes = property(lambda self: ((OuterRef(OuterKind.GRAD, self.param), self.mesh),))
    reduces = property(lambda self: ((self.stage, self.param),))

    @property
    def launches(self) -> tuple[Launch, ...]:
        moved = (MoveLaunch(self.move.move_key, str(self)),) if self.move is not None else ()
        return (*moved, ProgramLaunch(self.mesh, f"sum with the {self}")) if self.adds else moved

    def check(self, program: PipelineProgram, param_owner: Sequence[int]) -> str | None:
        if self.mesh != program.stage_mesh[param_owner[self.param]]:
            return "is not on the mesh of the parameter's owner"
        return None

    def __str__(self) -> str:
        return f"gradient of parameter {self.param} from stage {self.stage} into mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class FreeValues(StepInstruction):
    """Drops ``values``, each on its mesh, right after the last instruction reading or making it:
    the step holds no array longer than it needs (a gradient past the update that reads it)."""

    values: tuple[Located, ...]

    reads = property(lambda self: ())
    writes = property(lambda self: ())
    frees = property(lambda self: self.values)

    def __str__(self) -> str:
        meshes = sorted({m for _, m in self.values})
        return f"free {_names(r for r, _ in self.values)} on mesh{'es' if len(meshes) > 1 else ''} " \
               f"{', '.join(map(str, meshes))}"


@dataclasses.dataclass(frozen=True)
class AwaitArrivals(StepInstruction):
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return "wait for values other processes send here"


@dataclasses.dataclass(frozen=True)
class OutputSource:
    """Where a step output comes from: ``ref`` held on ``meshes``, the copy on mesh
    ``meshes[k]`` laid out as ``shardings[k]``; on several meshes the copies are joined as one
    array laid out as ``union`` (``None``: meshes of several platforms, which no array spans;
    the first mesh's copy). A literal output is ``literal``; an input returned as it came is
    placed as ``placed_as`` says (no meshes: a batch leaf, returned as given)."""

    ref: OuterRef
    meshes: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]
    literal: Any = None
    placed_as: PlaceLeaf | None = None
    union: NamedSharding | None = None


@dataclasses.dataclass(frozen=True)
class AssembleOutputs(StepInstruction):
    """The step's outputs (of the rewritten step), each from its ``OutputSource``."""

    outputs: tuple[OutputSource, ...]

    reads = property(lambda self: tuple((o.ref, m) for o in self.outputs
                                        if o.ref.kind is not OuterKind.LITERAL for m in o.meshes))
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"assemble {len(self.outputs)} outputs"


# Outputs at most this large (per copy), replicated on their mesh, that some process holds no
# copy of are copied onto every process: a loss, an aux metric, a gradient norm. Larger outputs
# (parameters, optimizer state) stay where their stage keeps them.
SHARE_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class SharedOutput:
    """Output ``output`` (of ``AssembleOutputs``), shaped ``shape`` of ``dtype``: its copy on
    ``source`` (a device of its mesh) copied onto ``devices``, the step's output devices (one per
    process, or the first mesh's in one process), where each process reads it."""

    output: int
    source: Any
    devices: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: Any
    # The devices already holding a copy (the output's own): no copy onto them.
    held: frozenset[Any] = frozenset()


@dataclasses.dataclass(frozen=True)
class ShareOutputs(StepInstruction):
    """``outputs`` copied onto the step's output devices (``share_outputs``), so that every
    process reads them and they combine as under ``jax.jit``: point-to-point copies from their
    source device (no collective: a collective
    launched while a peer still waits for this process's sends can block the device those
    sends need), every process joining each copy in this order."""

    outputs: tuple[SharedOutput, ...]

    # It copies the assembled outputs, no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(DeviceCopy(f"{self}: output {shared.output} onto {d}", shared.source, d)
                     for shared in self.outputs for d in shared.devices if d not in shared.held)

    def __str__(self) -> str:
        return f"share {len(self.outputs)} small outputs on the step's output devices"


@dataclasses.dataclass(frozen=True)
class JoinStackedLeaves(StepInstruction):
    """The rewritten step's outputs in pieces joined as the user sees the leaves they replace:
    a held leaf as one array over its pieces' devices, a gathered one moved home by
    ``GatheredArray.out_of`` and concatenated."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    reads = property(lambda self: ())
    writes = property(lambda self: ())

    @property
    def launches(self) -> tuple[Launch, ...]:
        return tuple(MoveLaunch(mv.move_key, f"{self}: piece {p} of leaf {i}")
                     for i, gathered in self.gathered for p, mv in enumerate(gathered.out_of) if mv is not None)

    def __str__(self) -> str:
        return f"join {len(self.held) + len(self.gathered)} stacked leaves from their pieces"


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The step's instructions, in the order every process runs them, and what they name.

    Attributes:
      instructions: the program.
      consts: the step's closed-over constants (``OuterKind.CONST`` refs index them).
      avals: the type of every value the instructions name (computed, moved, combined).
      leaf_shardings: per input leaf of the user's step, where the step keeps it between calls
        (a state leaf on its stage mesh, replicated over several meshes as one array, a
        stacked leaf as the user sees it); ``None``: a batch leaf, read per micro-batch.
    """

    instructions: tuple[StepInstruction, ...]
    consts: tuple = ()
    avals: Mapping[OuterRef, jax_ir.AbstractValue] = dataclasses.field(default_factory=dict)
    leaf_shardings: tuple[NamedSharding | None, ...] = ()

    def __iter__(self):
        return iter(self.instructions)
