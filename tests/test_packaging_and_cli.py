import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_compiler_and_runtime_install_only_under_meshpar(tmp_path):
    code = (
        "import importlib.util, meshpar.passes, meshpar.runtime;"
        "print(meshpar.passes.__file__, meshpar.runtime.__file__);"
        "print(importlib.util.find_spec('passes'), importlib.util.find_spec('runtime'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    files, specs = out.stdout.splitlines()
    assert files.split() == [os.path.join(ROOT, "passes", "__init__.py"), os.path.join(ROOT, "runtime", "__init__.py")]
    assert specs == "None None"


def test_sim_benchmark_cli_writes_records(tmp_path):
    path = tmp_path / "sim.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.resharding", "sim", "--json", str(path), "--balancers", "naive", "ensemble"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    records = json.loads(path.read_text())
    keys = {"suite", "case", "strategy", "balancer", "estimated_s", "lower_bound_s", "planner_s"}
    assert all(keys <= r.keys() for r in records)
    cases = {(r["suite"], r["case"]) for r in records}
    assert {("n_to_m", f"case{i}") for i in range(1, 10)} <= cases
    assert {("one_to_m", n) for n in ("1x1", "1x2", "1x3", "1x4", "2x2", "3x2", "4x2")} <= cases
    assert len(records) == 16 * 4 * 2
    assert "| n_to_m | case4 | 64 |" in out.stdout
    assert all(r["lower_bound_s"] <= r["estimated_s"] * (1 + 1e-9) for r in records)


def test_every_package_folder_is_listed_for_installation():
    # setup.cfg names each package (the compiler and runtime install under meshpar): a new
    # sub-package missing there would install without its modules.
    import configparser
    import pathlib

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    listed = set(config["options"]["packages"].split())
    homes = {"meshpar": "meshpar", "meshpar.passes": "passes", "meshpar.runtime": "runtime"}
    found = set()
    for package, folder in homes.items():
        for init in pathlib.Path(ROOT, folder).rglob("__init__.py"):
            parts = init.parent.relative_to(pathlib.Path(ROOT, folder)).parts
            found.add(".".join((package, *parts)))
    assert found == listed
