"""Example flax.linen models with pipeline-stage markers, for meshpar."""
