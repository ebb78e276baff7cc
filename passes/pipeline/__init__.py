"""The pipeline floor of the compiler, grouped by its data flow: ``cutting`` the traced step
into stages, ``scheduling`` their tasks, ``placing`` stages and values on meshes, and
``lowering`` it all to the programs the runtime interprets. ``step_primitives`` and
``pipeline_options`` sit below the groups; ``passes.pipeline_driver`` runs the passes in order."""
