"""Placing the cut step: a mesh for every stage (the schedule's placement), data-parallel
replicas and their gradient reductions, where every value of the step lives (a stacked
parameter as per-stage slices), and how each value crossing two meshes moves."""
