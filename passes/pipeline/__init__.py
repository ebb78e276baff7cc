"""The pipeline compiler: a traced train step cut into stages, laid out on meshes, scheduled and lowered to a per-mesh program (``pipeline_passes`` lists the passes)."""
