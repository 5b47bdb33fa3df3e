"""The Colab notebooks run top to bottom on CPU, on 8 simulated devices and on 1.

tests/test_packaging.py runs their install cell in a fresh venv, from a built wheel.
"""

import os
import pathlib
import re
import tomllib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


def install_cell(path):
    """The source of the notebook's install cell: the code cell that sets JAX_MINIMUM."""
    cells = [
        c.source
        for c in nbformat.read(path, as_version=4).cells
        if c.cell_type == "code" and "JAX_MINIMUM = " in c.source
    ]
    assert len(cells) == 1, path
    return cells[0]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 1])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, devices):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")  # the notebook sets its own devices
        and not k.startswith("GRADCOMM_")
    }
    env.update(GRADCOMM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=env)
    outputs = [o for c in notebook.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "gradcomm is already importable here: nothing to install." in text
    assert f"Devices: {devices} x cpu" in text
    # What a one-GPU Colab runtime sees with ONE_ACCELERATOR = "use": said plainly, not a 0
    # ratio or a crash; with 8 devices, bytes do cross.
    assert ("nothing crosses a wire" in text) == (devices == 1)
    if path.name == "tour.ipynb":
        assert ("x fewer)" in text) == (devices > 1)
    if path.name == "quickstart.ipynb":
        accuracies = re.findall(r"test accuracy (\d\.\d+)", text)
        assert len(accuracies) == 5 and float(accuracies[-1]) > 0.8, text


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} == {"quickstart.ipynb", "tour.ipynb"}


def test_install_cells_agree_with_the_requirements():
    cells = {install_cell(p) for p in NOTEBOOKS}
    assert len(cells) == 1, "the notebooks' install cells differ"
    (minimum,) = re.findall(r'^JAX_MINIMUM = "([^"]+)"', cells.pop(), re.M)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"jax>={minimum}" in dependencies
    assert f"jaxlib>={minimum}" in dependencies


def test_notebooks_name_no_repository_url():
    for path in NOTEBOOKS:  # gradcomm has no public home yet: no made-up URL
        assert "github.com" not in path.read_text()
