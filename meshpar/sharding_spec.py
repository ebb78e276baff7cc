"""The public name of ``meshpar.passes.model.sharding_spec``: the compiler owns the type, the API re-exports it."""

from meshpar.passes.model.sharding_spec import *  # noqa: F401,F403
from meshpar.passes.model.sharding_spec import __all__  # noqa: F401
