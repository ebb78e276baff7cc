"""The automatic planners and all they read: one protocol (``protocol.Planner``: a search and
the price of one layout), its registry (``planners.PLANNERS``: meshpar's own, AMP, Galvatron-BMW
and Alpa's stage DP), the four planners (ATP's tensor-parallel model, ``planner_atp``, prices
meshpar's), what they read of a model (layer profiles, measured collectives) and calibration's
fits of their cost model to measured steps (``calibration``)."""
