"""``PLANNERS``: the automatic planners (``protocol.Planner``) by the name a user gives them
(``meshpar.plan_parallelism(planner=...)``).

A new planner is one module defining ``plan`` and ``predict`` (``protocol``'s doc) and one entry
here: ``plan_parallelism`` and calibration take it by its name (``tests/planning/test_one_file_planner.py``
registers one from the test file alone). A name is resolved once, at the API
(``get_planner``).
"""

from __future__ import annotations

from . import planner_alpa, planner_amp, planner_galvatron, planner_meshpar
from .protocol import Planner

__all__ = ["PLANNERS", "get_planner"]

# Name -> planner. meshpar's own prices what the runtime runs (every schedule, device subsets,
# the gradient reduction as it runs); the baselines price what their papers model.
PLANNERS: dict[str, Planner] = {
    "meshpar": planner_meshpar,
    "amp": planner_amp,
    "galvatron": planner_galvatron,
    "alpa_dp": planner_alpa,
}


def get_planner(name: str) -> Planner:
    """The planner registered as ``name``.

    Raises:
      ValueError: ``name`` is not a key of ``PLANNERS``, listing them.
    """
    try:
        return PLANNERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"planner: expected one of {sorted(PLANNERS)}, got {name!r}") from None
