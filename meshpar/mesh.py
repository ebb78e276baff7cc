"""The public name of ``meshpar.passes.model.mesh``: the compiler owns the type, the API re-exports it."""

from meshpar.passes.model.mesh import *  # noqa: F401,F403
from meshpar.passes.model.mesh import __all__  # noqa: F401
