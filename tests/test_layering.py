"""The import rules of the layout, checked by scanning every module's imports (``ast``).

- The compiler (``meshpar.passes``) imports nothing from the API package or the runtime.
- The runtime (``meshpar.runtime``) imports of the compiler only the program format
  (``meshpar.passes.program``) and the one JAX-internals module (``meshpar.passes.jax_ir``).
- The program format is the compiler's lowest floor: it imports only itself and the shared base
  modules, and none of its types holds compiler IR (a ``Stage``, ``StageOperand``,
  ``Placement``, ``OuterCompute``, ``PipelineSchedule``).
- No import cycles among meshpar's modules, counting imports inside functions too.
- The compiler's floors import downward only: program -> model -> resharding -> pipeline ->
  simulation -> planning, and inside the pipeline floor its groups: cutting -> scheduling ->
  placing -> lowering.
- JAX's internals (``jax._src``) are imported by ``meshpar.passes.jax_ir`` alone, in the
  packages, the benchmarks, the examples and the tests.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"meshpar": ROOT / "meshpar", "meshpar.passes": ROOT / "passes", "meshpar.runtime": ROOT / "runtime"}
JAX_INTERNALS_MODULE = ROOT / "passes" / "jax_ir.py"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The meshpar modules ``name`` imports, wherever in the file; ``from pkg import mod`` counts ``pkg.mod``."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        else:
            continue
        found |= {t for t in targets if t == "meshpar" or t.startswith("meshpar.")}
    return found


MODULES = _modules()
IMPORTS = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    for package in ("meshpar.passes", "meshpar.runtime"):
        if module == package or module.startswith(package + "."):
            return package
    return "meshpar"


def test_scanner_sees_the_packages():
    # The rules below are vacuous if the scan finds nothing: check it sees what it must.
    assert len(MODULES) > 70
    assert "meshpar.passes.pipeline_driver" in IMPORTS["meshpar.step_compiler"] or any(
        m.startswith("meshpar.passes.pipeline") for m in IMPORTS["meshpar.step_compiler"])
    assert "meshpar.passes.program.pipeline_instructions" in IMPORTS["meshpar.runtime.program_interpreter"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "meshpar.passes"))
def test_compiler_imports_only_the_compiler(module):
    outside = sorted(m for m in IMPORTS[module] if _layer(m) != "meshpar.passes")
    assert not outside, f"{module} imports {outside}: the compiler sits below the API package and the runtime"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "meshpar.runtime"))
def test_runtime_imports_only_compiler_and_runtime(module):
    outside = sorted(m for m in IMPORTS[module] if _layer(m) == "meshpar")
    assert not outside, f"{module} imports {outside}: the runtime reads IR types and executors, never the API"


FORMAT = "meshpar.passes.program"
JAX_IR = "meshpar.passes.jax_ir"


def _in_format(module: str) -> bool:
    return module == FORMAT or module.startswith(FORMAT + ".")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "meshpar.runtime"))
def test_runtime_imports_of_the_compiler_only_the_program_format(module):
    compiler = sorted(m for m in IMPORTS[module] if _layer(m) == "meshpar.passes" and m != "meshpar.passes"
                      and not _in_format(m) and m != JAX_IR)
    assert not compiler, (f"{module} imports {compiler}: the runtime reads the program format "
                          f"({FORMAT}) and jax_ir, nothing else of the compiler")


def test_the_runtime_reads_the_program_format():
    # The rule above is vacuous if the runtime imported nothing of the compiler.
    used = {m for module in MODULES if _layer(module) == "meshpar.runtime" for m in IMPORTS[module]}
    assert {f"{FORMAT}.pipeline_instructions", f"{FORMAT}.step_instructions", f"{FORMAT}.stage_kernel",
            f"{FORMAT}.moves", JAX_IR} <= used


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in_format(m)))
def test_the_program_format_is_the_lowest_floor(module):
    above = sorted(m for m in IMPORTS[module] if _layer(m) != "meshpar.passes" or (
        not _in_format(m) and m not in BASE and m != "meshpar.passes"))
    assert not above, f"{module} imports {above}: the program format imports only itself and {sorted(BASE)}"


FORBIDDEN_IR = ("Stage", "StageOperand", "Placement", "OuterCompute", "OuterMove", "PipelineSchedule", "StageGraph", "StepLayout")


def _format_types() -> list[type]:
    import importlib
    import inspect

    found = []
    for module in sorted(m for m in MODULES if _in_format(m)):
        mod = importlib.import_module(module)
        found += [obj for _, obj in inspect.getmembers(mod, inspect.isclass) if obj.__module__ == module]
    return found


def test_no_format_type_holds_compiler_ir():
    """Every field of every type of the program format, and every argument and result of its
    methods, names no compiler IR (issue 43: operands are values the runtime can use as they are)."""
    import dataclasses
    import re

    types = _format_types()
    assert len(types) > 30  # the scan sees the format's types
    holding = {}
    for cls in types:
        hints = {}
        if dataclasses.is_dataclass(cls):
            hints |= {f.name: str(f.type) for f in dataclasses.fields(cls)}
        for name, member in vars(cls).items():
            fn = member.fget if isinstance(member, property) else member
            if callable(fn) and getattr(fn, "__annotations__", None):
                hints |= {f"{name}.{k}": str(v) for k, v in fn.__annotations__.items()}
        bad = {k: v for k, v in hints.items() if any(re.search(rf"\b{f}\b", v) for f in FORBIDDEN_IR)}
        if bad:
            holding[cls.__name__] = bad
    assert not holding, f"program format types hold compiler IR: {holding}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _in_format(m)))
def test_the_program_format_holds_no_compiler_pass(module):
    import importlib
    import inspect

    from meshpar.passes.compiler_pass import is_compiler_pass

    mod = importlib.import_module(module)
    passes = [name for name, fn in inspect.getmembers(mod, inspect.isfunction) if is_compiler_pass(fn)]
    assert not passes, f"{module} defines compiler passes {passes}: the format holds what passes make"


def test_the_passes_are_marked():
    # The rule above is vacuous if passes are not marked: the driver and the lowering are.
    from meshpar.passes.compiler_pass import is_compiler_pass
    from meshpar.passes.pipeline_driver import compile_pipeline
    from meshpar.passes.pipeline.lowering.pipeline_program import lower_to_program
    from meshpar.passes.pipeline.lowering.step_program import lower_step
    from meshpar.passes.program.step_instructions import StepProgram

    assert is_compiler_pass(compile_pipeline) and is_compiler_pass(lower_to_program) and is_compiler_pass(lower_step)
    assert not is_compiler_pass(StepProgram)


def test_the_ir_scan_catches_compiler_ir():
    # The rule above is vacuous if the scan misses a field naming IR: a made-up one is caught.
    import dataclasses
    import re

    Leaky = dataclasses.make_dataclass("Leaky", [("stage", "Stage")], frozen=True)
    assert any(re.search(rf"\b{f}\b", str(fld.type)) for fld in dataclasses.fields(Leaky) for f in FORBIDDEN_IR)


def test_no_import_cycles():
    graph = nx.DiGraph()
    for module, targets in IMPORTS.items():
        # A package's __init__ re-exports its modules; a module importing a sibling through
        # the package is the only edge into it that can close a loop, so packages are kept.
        graph.add_edges_from((module, t) for t in targets if t in MODULES and t != module)
    cycles = list(nx.simple_cycles(graph, length_bound=6))
    real = [c for c in cycles if not any(m in ("meshpar", "meshpar.passes", "meshpar.runtime") for m in c)]
    assert not real, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in real[:5])


def _imports_jax_internals(path: pathlib.Path) -> list[str]:
    """The ``jax._src`` modules ``path`` imports, wherever in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [n for n in names if n == "jax._src" or n.startswith("jax._src.")]
    return found


@pytest.mark.parametrize("folder", ["meshpar", "passes", "runtime", "benchmarks", "examples", "tests"])
def test_jax_internals_only_in_jax_ir(folder):
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}"
    offenders = {str(f.relative_to(ROOT)): _imports_jax_internals(f) for f in files if f != JAX_INTERNALS_MODULE}
    offenders = {f: names for f, names in offenders.items() if names}
    assert not offenders, f"import JAX's internals outside passes/jax_ir.py: {offenders}"


def test_jax_internals_scan_sees_them():
    # The rule above is vacuous if the scan misses imports: the one module that has them must show them.
    assert "jax._src.interpreters" in _imports_jax_internals(JAX_INTERNALS_MODULE)


# The compiler's floors, lowest first: a module imports its own floor or lower ones, and the
# shared base modules; the driver sits above them all. Inside the pipeline floor, its groups
# follow the data flow the same way, above its shared primitives and options.
FLOORS = ("program", "model", "resharding", "pipeline", "simulation", "planning")
BASE = {"meshpar.passes.jax_ir", "meshpar.passes.compiler_pass", "meshpar.passes.verification", "meshpar.passes.policies"}
PIPELINE_GROUPS = ("cutting", "scheduling", "placing", "lowering")
PIPELINE_BASE = {"meshpar.passes.pipeline.step_primitives", "meshpar.passes.pipeline.pipeline_options"}


def _rank(module: str, names: tuple[str, ...], depth: int) -> int | None:
    parts = module.split(".")
    return names.index(parts[depth]) if len(parts) > depth + 1 and parts[depth] in names else None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _rank(m, FLOORS, 2) is not None))
def test_compiler_floors_import_only_downward(module):
    floor = _rank(module, FLOORS, 2)
    up = sorted(t for t in IMPORTS[module] if _layer(t) == "meshpar.passes" and t not in BASE
                and (_rank(t, FLOORS, 2) is None or _rank(t, FLOORS, 2) > floor))
    assert not up, (f"{module} (floor {FLOORS[floor]}) imports {up}: the floors read "
                    f"{' -> '.join(FLOORS)}, and a module imports its own floor or lower ones")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _rank(m, PIPELINE_GROUPS, 3) is not None
                                          and m.startswith("meshpar.passes.pipeline.")))
def test_pipeline_groups_follow_the_data_flow(module):
    group = _rank(module, PIPELINE_GROUPS, 3)
    up = sorted(t for t in IMPORTS[module] if t.startswith("meshpar.passes.pipeline") and t not in PIPELINE_BASE
                and (_rank(t, PIPELINE_GROUPS, 3) is None or _rank(t, PIPELINE_GROUPS, 3) > group))
    assert not up, (f"{module} ({PIPELINE_GROUPS[group]}) imports {up}: the pipeline's groups read "
                    f"{' -> '.join(PIPELINE_GROUPS)}")


def test_floor_scan_sees_every_floor_and_group():
    # The two rules above are vacuous if the scan misses a floor or a group.
    seen = {_rank(m, FLOORS, 2) for m in MODULES} | {None}
    groups = {_rank(m, PIPELINE_GROUPS, 3) for m in MODULES if m.startswith("meshpar.passes.pipeline.")}
    assert seen >= set(range(len(FLOORS))) and groups >= set(range(len(PIPELINE_GROUPS)))
