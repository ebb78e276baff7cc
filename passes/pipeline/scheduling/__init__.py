"""Scheduling: the tasks of a step, the registered schedules (GPipe to DualPipeV) as typed tasks
per mesh, and the cross-mesh dependency graph that orders their launches."""
