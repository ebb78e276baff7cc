"""The public name of ``meshpar.passes.model.tiles``: the compiler owns the type, the API re-exports it."""

from meshpar.passes.model.tiles import *  # noqa: F401,F403
from meshpar.passes.model.tiles import __all__  # noqa: F401
