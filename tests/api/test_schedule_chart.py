"""``python -m meshpar.schedule_chart``: the text chart of a built-in schedule against one derived
by hand, a CSV's order drawn as written, the PNG, and every bad input named."""

import subprocess
import sys
from pathlib import Path

import pytest

from repo_paths import ROOT_DIR

from meshpar import schedule_chart
from meshpar.passes.pipeline.scheduling.pipeline_schedule import make_schedule
from meshpar.passes.pipeline.scheduling.schedule_csv import format_schedule_csv, load_schedule_csv

REPO = Path(ROOT_DIR)

# 1F1B, 2 meshes, 2 micro-batches, F = I = W = 1 (B = 2), free transfers; one cell (4 characters)
# per unit. Mesh 1: F1.0 at 1, B1.0 2-4, F1.1 4-5, B1.1 5-7. Mesh 0: F0.0, F0.1, then B0.0 waits
# for B1.0 (4-6) and B0.1 for B1.1 (7-9). Step 9; busy 2 x 6 of 2 x 9: bubble 1/3.
ONE_F_ONE_B = (
    "1f1b: 2 meshes, 2 stages, 2 micro-batches; bubble 33.3%, step 9 (F 1, I 1, W 1, transfer 0)\n"
    "mesh 0 |0F0 0F1 ........0B0     ....0B1\n"
    "mesh 1 |....1F0 1B0     1F1 1B1\n"
    "F forward, I backward input pass, W backward weight pass, B whole backward, . idle\n"
)
ARGS = ["1f1b", "--meshes", "2", "--micro-batches", "2"]
# Interleaved ZB-H1-like order of my own: two stages per mesh, split backwards.
MY_ORDER = ("0F0,2F0,0F1,2F1,2I0,2W0,2I1,0I0,2W1,0W0,0I1,0W1\n"
            "1F0,3F0,1F1,3I0,3F1,3W0,3I1,1I0,3W1,1I1,1W0,1W1\n")


def test_text_chart_of_a_built_in_schedule_is_the_hand_derived_one(capsys):
    assert schedule_chart.main(ARGS) == 0
    assert capsys.readouterr().out == ONE_F_ONE_B


def test_the_command_line_runs_as_a_module():
    run = subprocess.run([sys.executable, "-m", "meshpar.schedule_chart", *ARGS], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert (run.returncode, run.stdout) == (0, ONE_F_ONE_B), run.stderr


def test_a_csv_order_is_drawn_as_written(tmp_path, capsys):
    """Its size comes from the file; each mesh's lane lists the file's line, the title its name."""
    path = tmp_path / "my_order.csv"
    path.write_text(MY_ORDER)
    assert schedule_chart.main(["--csv", str(path)]) == 0
    title, *lanes, legend = capsys.readouterr().out.splitlines()
    assert title.startswith("my_order: 2 meshes, 4 stages, 2 micro-batches; bubble ")
    assert [lane.split("|")[1].replace(".", " ").split() for lane in lanes] == [
        line.split(",") for line in MY_ORDER.splitlines()]
    assert legend.startswith("F forward")


def test_bubble_in_the_title_is_the_simulators(capsys):
    c = schedule_chart.chart("interleaved_zb", 4, 8, 2, schedule_chart.PassTimes(forward=2.0, transfer=0.5))
    schedule_chart.main(["interleaved_zb", "--meshes", "4", "--micro-batches", "8", "--forward", "2",
                         "--transfer", "0.5"])
    title = capsys.readouterr().out.splitlines()[0]
    assert f"bubble {c.step.bubble_fraction:.1%}, step {c.step.step_seconds:g} (F 2, I 1, W 1, transfer 0.5)" in title
    assert c.schedule.num_meshes == 4 and c.schedule.num_stages == 8


def test_png_and_csv_outputs(tmp_path, capsys):
    png, csv = tmp_path / "chart.png", tmp_path / "order.csv"
    assert schedule_chart.main([*ARGS, "--png", str(png), "--save-csv", str(csv)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == ONE_F_ONE_B + f"wrote {png}\nwrote {csv}\n"
    assert csv.read_text() == format_schedule_csv(make_schedule("1f1b", 2, 2, [(0, 1)]).sequences)
    assert load_schedule_csv(csv).size == (2, 2, 2)


def test_png_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exit_:
        schedule_chart.main([*ARGS, "--png", str(tmp_path / "chart.png")])
    assert exit_.value.code == 2
    assert "error: --png: drawing a PNG needs matplotlib; install it with pip install 'meshpar[plot]'" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv,message", [
    (["interleaved_1f1b", "--meshes", "2", "--micro-batches", "3"],
     "num_micro_batches: interleaved_1f1b with virtual stages needs a multiple of 2 micro-batches (2 meshes), got 3; "
     "pass e.g. 2 or 4"),
    (["interleaved_zb", "--meshes", "4", "--micro-batches", "9"],
     "num_micro_batches: interleaved_zb with virtual stages needs a multiple of 2 micro-batches (4 meshes), got 9"),
    (["zb_v", "--meshes", "2", "--micro-batches", "3"],
     "num_micro_batches: zb_v needs at least 4 micro-batches on 2 meshes, got 3"),
    (["zb_v", "--meshes", "2", "--micro-batches", "4", "--stages-per-mesh", "3"],
     "stages_per_mesh, num_meshes: zb_v places exactly 2 stages on each mesh"),
    (["1f1b", "--meshes", "2"], "--meshes, --micro-batches: 1f1b runs at any size; pass both"),
    (["nope", "--meshes", "2", "--micro-batches", "2"], "schedule: unknown 'nope'"),
    ([], "NAME, --csv: give a registered schedule name or --csv FILE, exactly one of them"),
    ([*ARGS, "--forward", "0", "--backward-input", "0", "--backward-weight", "0"],
     "--forward, --backward-input, --backward-weight: expected a positive time for at least one pass"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        schedule_chart.main(argv)
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ("0F0,0F1,0B0,0B1\n1F0,1SEND_B0,1B0,1F1,1B1\n", "line 2, column 2 (rank 1): '1SEND_B0' is torch's lowered SEND_B"),
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "schedule: the order of 'order' deadlocks on the cycle"),
])
def test_a_bad_csv_is_named_with_its_path(text, message, tmp_path, capsys):
    path = tmp_path / "order.csv"
    path.write_text(text)
    with pytest.raises(SystemExit):
        schedule_chart.main(["--csv", str(path)])
    err = capsys.readouterr().err
    assert message in err and f"(in {path})" in err


def test_a_csv_at_another_size_is_refused(tmp_path, capsys):
    path = tmp_path / "order.csv"
    path.write_text(MY_ORDER)
    with pytest.raises(SystemExit):
        schedule_chart.main(["--csv", str(path), "--micro-batches", "4"])
    assert ("num_micro_batches: schedule 'order' is an order for 4 stages on 2 meshes over 2 micro-batches; got "
            "num_micro_batches=4") in capsys.readouterr().err
