"""Lowering to what the runtime interprets: the per-mesh pipeline program, compute runs fused
into one program, the stage kernels the runtime compiles, and the whole step program."""
