"""The Colab notebooks run top to bottom on CPU, on 8 simulated devices (the tour also on 1),
and are committed with the outputs of that run on 8 devices; the tour covers every method of
the README's methods table.

tests/project/test_packaging.py runs their install cell in a fresh venv, from a built wheel.

After a change to a notebook, or to gradcomm where it changes what a notebook prints, write
the outputs again, from a clean tree (nothing uncommitted under gradcomm/), with

    python tests/project/test_notebooks.py

which executes each notebook as `test_notebook_runs` does on 8 devices and writes it back.
"""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
COMMITTED_DEVICES = 8  # the committed outputs are those of a run on 8 simulated CPU devices
# The methods that send at least 1.1x fewer bytes per step than allreduce on 8 devices.
COMPRESSING = {
    "terngrad",
    "lags",
    "slgs",
    "sgp",
    "gradient_dropping + periodic_average",
    "powersgd",
    "low_precision",
    "diloco",
    "streaming_diloco",
    "onebit_adam",
    "local_sgd",
}
# A result line of the tour's `train`.
TOUR_ROW = re.compile(
    r"^(?P<label>[\w +]+): loss (?P<loss>\d+\.\d+), test accuracy (?P<accuracy>\d\.\d+), "
    r"(?P<sent>[\d,]+) bytes per device per step \((?P<against>[^)]*)\)$",
    re.M,
)


def code_cell(path, marker):
    """The source of the notebook's one code cell that contains `marker`: "JAX_MINIMUM = "
    finds the install cell, "GRADCOMM_CPU_DEVICES" the device cell (which says what one
    device means)."""
    cells = [
        c.source
        for c in nbformat.read(path, as_version=4).cells
        if c.cell_type == "code" and marker in c.source
    ]
    assert len(cells) == 1, (path, marker)
    return cells[0]


def execute(path, devices):
    """The notebook at `path` run top to bottom in a fresh kernel on `devices` simulated CPU
    devices, with its outputs: the executor of the tests and of this file's `main`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")  # the notebook sets its own devices
        and not k.startswith("GRADCOMM_")
    }
    env.update(GRADCOMM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,  # no timestamps in the committed notebooks
        coalesce_streams=True,  # one output per stream, however the kernel flushed it
    )
    client.execute(env=env)
    return notebook


def code_cells(notebook):
    return [c for c in notebook.cells if c.cell_type == "code"]


def cell_text(cell):
    return "".join(o.get("text", "") for o in cell.get("outputs", []))


def notebook_text(notebook):
    return "".join(cell_text(c) for c in code_cells(notebook))


def machine_paths():
    """Absolute paths of this machine that no output may show."""
    places = {str(ROOT), sys.prefix, sys.base_prefix, tempfile.gettempdir()}
    return sorted(p for p in places | {str(pathlib.Path.home())} if len(p) > 1)


def output_problems(notebook):
    """What keeps a notebook's outputs from being committed: errors, absolute paths."""
    problems = []
    for i, cell in enumerate(code_cells(notebook)):
        for output in cell.outputs:
            if output.output_type == "error":
                problems.append(f"code cell {i}: {output.ename}: {output.evalue}")
            text = output.get("text", "") + str(output.get("data", ""))
            problems += [f"code cell {i} shows the path {p}" for p in machine_paths() if p in text]
            if re.search(r"(?<![\w.])/(home|Users|root|tmp|work)/", text):
                problems.append(f"code cell {i} shows an absolute path: {text[:200]!r}")
    return problems


def skeleton(cell):
    """A cell's output text with its numbers masked and its Markdown table rows dropped:
    what a fresh run must print again (losses, timings and the collectives the compiler
    picks may change; the lines, their words and the device line may not)."""
    lines = []
    for line in cell_text(cell).splitlines():
        if line.startswith("Devices: "):
            lines.append(line)
        elif not line.startswith("|"):
            lines.append(re.sub(r"\d[\d,]*(\.\d*)?(e[-+]?\d+)?", "#", line))
    return lines


def readme_factories():
    """The factories of the README's methods table."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ")]
    assert rows[0][3].strip() == "factory", rows[0]
    return {name for row in rows[2:] for name in re.findall(r"`(\w+)`", row[3])}


def tour_rows(notebook):
    """The tour's result lines, each with the source of the cell that printed it."""
    return [
        (cell.source, match)
        for cell in code_cells(notebook)
        for match in TOUR_ROW.finditer(cell_text(cell))
    ]


def check_tour(notebook, devices):
    """Every method of the README's table ran in its own section and learned; on several
    devices the compressing ones send fewer bytes than allreduce, on one nothing is sent."""
    rows = tour_rows(notebook)
    labels = [m["label"] for _, m in rows]
    assert len(labels) == len(set(labels)), labels
    ran = {name for label in labels for name in label.split(" + ")}
    assert ran == readme_factories(), f"the tour ran {sorted(ran)}"
    for source, m in rows:  # each in the section that calls its factory
        for name in m["label"].split(" + "):
            assert f"gradcomm.{name}" in source, (name, source)
        assert float(m["accuracy"]) > 0.5, m[0]  # chance is 0.1
    fewer = {m["label"] for _, m in rows if m["against"].endswith("x fewer than allreduce")}
    if devices > 1:
        assert fewer == COMPRESSING, sorted(fewer)
        assert all(float(m["sent"].replace(",", "")) > 0 for _, m in rows)
    else:
        assert not fewer
        assert {m["sent"] for _, m in rows} == {"0"}


# Each notebook runs on 8 devices (its committed outputs are that run's); the tour also runs on
# 1, where every method of the README's table must report 0 bytes. The quickstart's 1-device
# run checked nothing the tour's does not: its device cell is the tour's
# (`test_notebooks_share_the_device_cell`), and its Adasum `train_step` and `wire.measure` on
# one device are the tour's too.
RUNS = [(path, 8) for path in NOTEBOOKS] + [(ROOT / "colab" / "tour.ipynb", 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "devices"), RUNS, ids=lambda x: getattr(x, "name", x))
def test_notebook_runs(path, devices):
    notebook = execute(path, devices)
    assert not output_problems(notebook)
    text = notebook_text(notebook)
    assert "gradcomm is already importable here: nothing to install." in text
    assert f"Devices: {devices} x cpu" in text
    # What a one-GPU Colab runtime sees with ONE_ACCELERATOR = "use": said plainly, not a 0
    # ratio or a crash; with 8 devices, bytes do cross.
    assert ("nothing crosses a wire" in text) == (devices == 1)
    if path.name == "tour.ipynb":
        assert ("x fewer than allreduce)" in text) == (devices > 1)
        check_tour(notebook, devices)
    if path.name == "quickstart.ipynb":
        accuracies = re.findall(r"test accuracy (\d\.\d+)", text)
        assert len(accuracies) == 5 and float(accuracies[-1]) > 0.8, text
    if devices == COMMITTED_DEVICES:  # the committed outputs are this run's
        committed = code_cells(nbformat.read(path, as_version=4))
        fresh = code_cells(notebook)
        assert len(committed) == len(fresh)
        for i, (old, new) in enumerate(zip(committed, fresh, strict=True)):
            assert skeleton(old) == skeleton(new), (
                f"{path.name}, code cell {i}: the committed outputs are not those of a fresh "
                f"run; write them again with `python tests/project/test_notebooks.py`"
            )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_with_outputs(path):
    """Executed top to bottom on 8 devices, every cell that prints has its output, and
    nothing shows an error or a path of the machine that ran it."""
    notebook = nbformat.read(path, as_version=4)
    cells = code_cells(notebook)
    hint = "write the outputs with `python tests/project/test_notebooks.py`"
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), hint
    prints = re.compile(r"^(print|\w[\w, ]* = train)\(", re.M)  # at the top level
    assert not [c.source for c in cells if prints.search(c.source) and not cell_text(c)], hint
    assert not output_problems(notebook)
    text = notebook_text(notebook)
    assert "gradcomm is already importable here: nothing to install." in text
    assert f"Devices: {COMMITTED_DEVICES} x cpu\n" in text
    if path.name == "tour.ipynb":
        check_tour(notebook, COMMITTED_DEVICES)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} == {"quickstart.ipynb", "tour.ipynb"}


def test_notebooks_share_the_device_cell():
    """The cell that picks the devices, and prints what one device means, is one cell: the
    tour's run on 1 device (`test_notebook_runs`) checks it for every notebook."""
    cells = {code_cell(p, "GRADCOMM_CPU_DEVICES") for p in NOTEBOOKS}
    assert len(cells) == 1, "the notebooks' device cells differ"
    assert "nothing crosses a wire" in cells.pop()


def test_install_cells_agree_with_the_requirements():
    cells = {code_cell(p, "JAX_MINIMUM = ") for p in NOTEBOOKS}
    assert len(cells) == 1, "the notebooks' install cells differ"
    (minimum,) = re.findall(r'^JAX_MINIMUM = "([^"]+)"', cells.pop(), re.M)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"jax>={minimum}" in dependencies
    assert f"jaxlib>={minimum}" in dependencies


def test_notebooks_name_no_repository_url():
    for path in NOTEBOOKS:  # gradcomm has no public home yet: no made-up URL
        assert "github.com" not in path.read_text()


def main(argv=None):
    """Executes the notebooks as the tests do, on 8 devices, and writes them back."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "notebooks", nargs="*", type=pathlib.Path, help="default: every colab/*.ipynb"
    )
    paths = [p.resolve() for p in parser.parse_args(argv).notebooks] or NOTEBOOKS
    status = ["git", "status", "--porcelain", "--", "gradcomm", "pyproject.toml"]
    changed = subprocess.run(status, cwd=ROOT, capture_output=True, text=True, check=False)
    if changed.stdout.strip():
        print(f"warning: uncommitted changes under gradcomm/:\n{changed.stdout}", file=sys.stderr)
    for path in paths:
        notebook = execute(path, COMMITTED_DEVICES)
        problems = output_problems(notebook)
        if problems:
            sys.exit(f"{path.name} not written:\n" + "\n".join(problems))
        nbformat.write(notebook, path)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
