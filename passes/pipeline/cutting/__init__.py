"""Cutting the traced step: the loss into forward stages at its markers (or Alpa's automatic
layers), scans over layers split where stages cut them, stacked parameters sliced per stage,
the step around the gradient split per mesh, each stage's parts (forward, backward in two),
and how micro-batches combine."""
