"""The Colab notebooks run top to bottom on CPU: 8 simulated devices, and 1."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [8, 1])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, devices, monkeypatch):
    for key in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS"):  # the notebook sets its own devices
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("GRADCOMM_CPU_DEVICES", str(devices))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env={**os.environ, "JAX_PLATFORMS": "cpu"})
    errors = [o for c in notebook.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if devices == 1:  # what a one-GPU Colab runtime sees: said plainly, not a 0 or a crash
        text = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
        assert "nothing crosses a wire" in text


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} == {"quickstart.ipynb", "tour.ipynb"}
