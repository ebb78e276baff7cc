"""The program format: what the compiler hands the runtime, and all the runtime reads of it.

The compiler's lowest floor: these modules import nothing else of the compiler but the base
modules (``jax_ir``, ``policies``, ``verification``). The lowering passes (``pipeline.lowering``, ``pipeline.placing.plan_moves``)
make these types; ``meshpar.runtime`` interprets them, one handler per instruction. No
compiler IR (a ``Stage``, a ``StageOperand``, an ``OuterCompute``, a ``PipelineSchedule``) appears
in them: operands are shardings, jaxprs, buffer ids and lowered moves.
"""
