"""No string chooses a policy past the API (issue 43, item 3).

The user names policies by strings (``schedule="1f1b"``, ``resharding="broadcast"``,
``executor="p2p"``, ``gradient_reduction="per_step"``, ``reduction="mean"``, ``order="gated"``);
the API modules below resolve each name once, to a registry's object (``SCHEDULES``,
``STRATEGIES``, ``BALANCERS``) or a ``passes.policies.Policy`` member, and everything past them
asks that object what to do. So the compiler (``passes/``), the runtime (``runtime/``) and the
rest of ``meshpar/`` compare no value with a string literal (``==``, ``!=``, ``in``, ``is``,
``match``), except the few listed in ``ALLOWED``: strings that are data of another format (a
jaxpr primitive's name, an HLO or trace token, JAX's own argument values), each with why.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("passes", "runtime", "meshpar")

# The API boundary: where the user's names are resolved (and may be compared, once).
API_MODULES = {
    "meshpar/pipeshard_parallel.py",  # PipeshardParallel: schedule, strategy, balancer, executor, reductions
    "meshpar/reshard.py",  # reshard: strategy, balancer, executor, order
    "meshpar/autodiff.py",  # value_and_grad: the loss reduction
    "meshpar/planning.py",  # plan_parallelism: planner, schedules, gradient reduction
    "meshpar/parallelize.py",  # parallelize: the method
    "meshpar/distributed.py",  # initialize: passes JAX's own cluster_detection_method on
    "meshpar/checkpoint.py",  # save / restore
    "meshpar/schedule_chart.py",  # a command line: its arguments
}

# (file, the comparison's source) -> why it is not a policy choice. Every entry must still match.
ALLOWED = {
    ("passes/model/sharding_spec.py", 't == "R"'):
        "parses the ShardingSpec text format ('R' is a replicated dimension's token)",
    ("passes/planning/hlo_collectives.py", 'm.group("phase") != "-start"'):
        "parses HLO text: an async collective's start half",
    ("passes/planning/hlo_collectives.py", 'm.group("phase") == "-start"'):
        "parses HLO text: an async collective's start half",
    ("passes/pipeline/cutting/jaxpr_flops.py", 'name == "dot_general"'):
        "a jaxpr primitive's name",
    ("passes/pipeline/cutting/jaxpr_flops.py", 'name == "conv_general_dilated"'):
        "a jaxpr primitive's name",
    ("passes/pipeline/cutting/jaxpr_flops.py", 'name == "scan"'):
        "a jaxpr primitive's name",
    ("passes/jax_ir.py", 'name == "cur_abstract_mesh"'):
        "a field of JAX's JaxprEqnContext",
    ("passes/jax_ir.py", 'name == "xla_metadata"'):
        "a field of JAX's JaxprEqnContext",
    ("passes/jax_ir.py", 's not in ("configs", "__weakref__")'):
        "slots of JAX's JaxprEqnContext",
    ("passes/jax_ir.py", 'getattr(inline, "name", None) in ("JAX_EARLY", "JAX_LATE")'):
        "JAX's own inlining enum, read by name across JAX versions",
    ("passes/jax_ir.py", 'cluster_detection_method == "deactivate"'):
        "JAX's own jax.distributed argument value, passed through",
    ("passes/pipeline/cutting/split_scans.py", 'k in ("sharding", "out_sharding")'):
        "a jaxpr equation's parameter names",
    ("passes/simulation/timeline.py", 'e["ph"] != "X"'):
        "parses the Chrome trace event format ('X': a complete event)",
    ("passes/planning/planner_galvatron.py", 'name in ("dp", "sdp")'):
        "Galvatron's own dimension labels (the baseline paper's search space), not a meshpar policy",
    ("runtime/program_interpreter.py", 'f.name == "micro_batch"'):
        "a dataclass field's name",
    ("runtime/stage_executables.py", 'devices[0].platform == "cpu"'):
        "the devices' platform (XLA:CPU orders cross-process collectives differently), not a user's choice",
    ("runtime/placement.py", 'next(iter(devices)).platform == "cpu"'):
        "the device's platform (a CPU array's host view is its own buffer), not a user's choice",
    ("meshpar/calibration.py", 'platform != "cpu"'):
        "the devices' platform, not a user's choice",
    ("passes/planning/planner_amp.py", 'sorted(placement) != ["dp", "pp", "tp"]'):
        "AMP's own axis labels (the baseline paper's), checked as given",
}


def _is_text(node: ast.AST) -> bool:
    """A string literal, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        return all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
    return False


def _chooses(left: ast.AST, op: ast.cmpop, right: ast.AST) -> bool:
    """Whether ``left op right`` compares a value with string literals: ``==``, ``!=``, ``is``,
    ``is not`` with a literal on either side, ``in`` / ``not in`` with literals on the right
    (``x in ("a", "b")``). A literal on the left of ``in`` asks whether a container holds a key
    or a text a substring (``"axes" in params``): no value is chosen by name."""
    if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
        return _is_text(left) or _is_text(right)
    if isinstance(op, (ast.In, ast.NotIn)):
        return _is_text(right)
    return False


def string_comparisons(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, source)`` of every comparison of a value with a string literal in ``source``
    (``_chooses``), and of every ``case`` matching a string literal; ``if __name__ ==
    "__main__"`` is not one."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(_chooses(a, op, b) for a, op, b in zip(operands, node.ops, operands[1:])):
                continue
            if any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands):
                continue
            found.append((node.lineno, ast.get_source_segment(source, node)))
        elif isinstance(node, ast.MatchValue) and _is_text(node.value):
            found.append((node.lineno, f"case {ast.get_source_segment(source, node)}"))
    return found


def _scanned_files() -> list[pathlib.Path]:
    files = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() not in API_MODULES:
                files.append(path)
    return files


def test_no_string_literal_chooses_a_policy_past_the_api():
    found, used = [], set()
    for path in _scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, text in string_comparisons(path.read_text(), rel):
            if (rel, text) in ALLOWED:
                used.add((rel, text))
            else:
                found.append(f"{rel}:{line}: {text}")
    assert not found, ("string comparisons past the API (resolve the name at the API to an object or a "
                       "passes.policies.Policy member, or allow-list a non-policy string with its reason):\n"
                       + "\n".join(found))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowed comparisons no longer in the code (drop them): {stale}"


def test_the_api_modules_exist():
    assert all((ROOT / m).is_file() for m in API_MODULES)
    assert len(_scanned_files()) > 100  # passes/, runtime/ and meshpar/ were found


@pytest.mark.parametrize("code", [
    'if strategy == "broadcast":\n    pass\n',
    'x = 1 if "per_micro_batch" != options.gradient_reduction else 2\n',
    'ok = order in ("gated", "rounds")\n',
    'ok = name not in {"naive"}\n',
    'ok = how[0] == "fetch"\n',
    'ok = executor is "auto"\n',
    'match strategy:\n    case "broadcast":\n        pass\n',
])
def test_a_policy_chosen_by_a_string_is_found(code):
    assert string_comparisons(code)


@pytest.mark.parametrize("code", [
    'if strategy is Executor.AUTO:\n    pass\n',
    'x = STRATEGIES[name]\n',
    'if __name__ == "__main__":\n    pass\n',
    'ok = order.gated\n',
    'ok = "axes" in params\n',
])
def test_what_is_not_a_string_comparison_is_not_found(code):
    assert not string_comparisons(code)
