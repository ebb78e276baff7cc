"""The compiled programs as text (passes/pipeline/lowering/program_text): the step program one line
per instruction, the pipeline program per mesh one line per instruction in order, each line the
instruction's own short ``__str__`` (never a jaxpr), so the text stays small."""

import optax

import meshpar
from examples.mlp import MLP
from meshpar.passes.pipeline.lowering.program_text import program_text
from pipeline_models import aux_sum_step, make_state, regression_batch

# Names of each kind as its line says them (the start of its ``__str__``).
STEP_WORDS = {"SplitStackedLeaves": "split ", "PlaceInputs": "place ", "RunCompute": "compute of ",
              "RunMove": "move of ", "FetchParameter": "fetch ", "FeedValue": "feed ", "FeedConstant": "feed const",
              "FoldKey": "fold key ", "SliceMicroBatches": "slice ", "MoveMicroBatches": "move ",
              "RunPipeline": "run the pipeline",
              "CombineMicroBatches": " micro-batches on mesh ", "ReduceGradient": "gradient of parameter ",
              "AwaitArrivals": "wait for values", "AssembleOutputs": "assemble ", "ShareOutputs": "share ",
              "JoinStackedLeaves": "join ", "FreeValues": "free "}
PIPELINE_WORDS = {"RunForward": "forward of stage", "RunBackward": "backward of stage", "Send": "send of ",
                  "Recv": "receive into ", "Free": "free of ", "RunFused": "fused ",
                  "ReduceGradients": "gradient reduction of stages", "RunBackwardInput": "input pass of stage",
                  "RunBackwardWeight": "weight pass of stage"}


def test_the_compiled_programs_print_one_short_line_per_instruction():
    batch = regression_batch()
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), batch["x"][:1])
    state = state.replace(tx=optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3)))
    state = state.replace(opt_state=state.tx.init(state.params))
    parallel = meshpar.parallelize(aux_sum_step, method=meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    compiled = parallel.get_compiled(state, batch)
    step, program = compiled.step, compiled.program
    text = program_text(step, program)
    assert str(compiled) == text  # print(step.get_compiled(...)) shows it
    lines = text.splitlines()

    # The step: a header, then one line per instruction, in order, each its own text.
    assert lines[0] == f"step program: {len(step.instructions)} instructions"
    step_lines = lines[1:1 + len(step.instructions)]
    assert [line.split(None, 1)[1] for line in step_lines] == [str(ins) for ins in step]
    for ins, line in zip(step, step_lines):
        assert STEP_WORDS[type(ins).__name__] in line, (type(ins).__name__, line)
    assert {type(i).__name__ for i in step} >= {"PlaceInputs", "RunCompute", "FeedValue", "SliceMicroBatches",
                                               "RunPipeline",
                                               "CombineMicroBatches", "ReduceGradient", "FreeValues",
                                               "AssembleOutputs"}

    # The pipeline: per mesh a header naming it, then its instructions in its own order.
    at = 1 + len(step.instructions)
    assert lines[at].startswith(f"pipeline program: {len(program.instructions)} meshes")
    at += 1
    for mesh, instructions in enumerate(program.instructions):
        assert lines[at].startswith(f"  mesh {mesh} (stages ") and f"{len(instructions)} instructions" in lines[at]
        mesh_lines = lines[at + 1:at + 1 + len(instructions)]
        texts = [line.split(None, 1)[1].rsplit("  (launch ", 1)[0] for line in mesh_lines]
        assert texts == list(map(str, instructions))
        for ins, line in zip(instructions, mesh_lines):
            assert PIPELINE_WORDS[type(ins).__name__] in line, (type(ins).__name__, line)
        at += 1 + len(instructions)
    assert at == len(lines)
    assert len(program.instructions) == 2

    # Short: no jaxpr anywhere (a RunCompute's own compute would print one), every line bounded.
    assert "lambda" not in text and "{ " not in text and "let" not in text.split()
    assert max(map(len, lines)) < 160
    assert len(text) < 120 * len(lines)
    # The compute's repr is what a careless line would print: far longer than its line.
    compute = next(i for i in step if type(i).__name__ == "RunCompute")
    assert len(repr(compute.jaxpr)) > 10 * len(str(compute))
