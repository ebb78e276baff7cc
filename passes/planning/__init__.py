"""The parallelism planners (meshpar, AMP, Galvatron-BMW, Alpa's DP, ATP) and what they read of a model: layer profiles and measured collectives."""
