"""The public name of ``meshpar.passes.model.cluster``: the compiler owns the type, the API re-exports it."""

from meshpar.passes.model.cluster import *  # noqa: F401,F403
from meshpar.passes.model.cluster import __all__  # noqa: F401
