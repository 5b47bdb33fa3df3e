"""Packaging: `python -m build` makes a wheel and an sdist that install and import in a fresh
venv; the notebooks' install cell installs them there without touching jax; the version has a
single source; CITATION.cff is valid and cites the paper of every method.

The fresh venv gets jax and jaxlib from pip's index, so those tests skip where pip reaches no
index, except under CI (CI=true), where they fail instead of hiding.
"""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import nbformat
import pytest

import gradcomm

ROOT = pathlib.Path(__file__).resolve().parents[2]
JAX = importlib.metadata.version("jax")
JAXLIB = importlib.metadata.version("jaxlib")
# Nothing of this environment leaks into the fresh venv's processes.
ENV = {
    **{
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("GRADCOMM_")
    },
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}


def run(command, cwd=None, env=None, check=True):
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if check:
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def install_cell():
    """The quickstart's install cell (the tour's is the same: tests/project/test_notebooks.py)."""
    notebook = nbformat.read(ROOT / "colab" / "quickstart.ipynb", as_version=4)
    (cell,) = [c.source for c in notebook.cells if "JAX_MINIMUM = " in c.source]
    return cell


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """Skips (fails under CI) unless pip can fetch this environment's jax from an index."""
    dest = tmp_path_factory.mktemp("probe")
    probe = [sys.executable, "-m", "pip", "download", "--no-deps", "--timeout", "15"]
    result = run([*probe, "--retries", "2", "--dest", dest, f"jax=={JAX}"], check=False)
    if result.returncode != 0:
        reason = f"pip cannot reach a package index: `pip download jax=={JAX}` failed:\n"
        reason += (result.stderr or result.stdout)[-400:]
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def dists(index, build_once, tmp_path_factory):
    """The wheel and the sdist that `python -m build` makes of a copy of the source tree,
    built once per test session (`build_once`, tests/conftest.py), whichever worker asks."""

    def build(out):
        source = tmp_path_factory.mktemp("source") / "gradcomm"
        shutil.copytree(
            ROOT,
            source,
            ignore=shutil.ignore_patterns(
                *(".git", ".*venv", "*.egg-info", "__pycache__", ".*_cache"),
                *("build", "dist", "out", "runs", "site"),  # outputs: ignored by git, or untracked
            ),
        )
        run([sys.executable, "-m", "build", "--outdir", out, source])

    out = build_once("dists", build)
    (wheel,) = out.glob("gradcomm-*.whl")
    (sdist,) = out.glob("gradcomm-*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def venv(index, tmp_path_factory):
    """The python of a fresh venv with this environment's jax and jaxlib and no gradcomm."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", path])
    python = path / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", "--no-compile", f"jax=={JAX}", f"jaxlib=={JAXLIB}"])
    return python


def without_gradcomm(python):
    run([python, "-m", "pip", "uninstall", "-y", "gradcomm"])
    assert_not_installed(python)


def assert_not_installed(python):
    check = "import importlib.util; assert importlib.util.find_spec('gradcomm') is None"
    run([python, "-c", check], cwd=python.parent)  # not the checkout: it holds gradcomm/


def run_install_cell(python, tmp_path, env=None, source=None):
    """The install cell run in an empty folder (two levels down: its search looks in ..)."""
    cwd = tmp_path / "work" / "notebook"
    cwd.mkdir(parents=True, exist_ok=True)
    return run([python, "-c", source or install_cell()], cwd=cwd, env=env, check=False)


def check_installed(python, tmp_path, compute=False):
    """gradcomm imports in the venv, from the venv (and computes); jax and jaxlib unchanged."""
    probe = """
import importlib.metadata, sys
import gradcomm
assert gradcomm.__file__.startswith(sys.prefix), gradcomm.__file__
print(gradcomm.__version__, importlib.metadata.version("jax"), importlib.metadata.version("jaxlib"))
"""
    if compute:  # orthogonal vectors: Adasum adds them
        probe += "from jax.numpy import array\n"
        probe += "print(gradcomm.adasum_pair(array([1.0, 0.0]), array([0.0, 1.0])).tolist())\n"
    out = run([python, "-c", probe], cwd=tmp_path).stdout.split("\n")
    assert out[0] == f"{gradcomm.__version__} {JAX} {JAXLIB}"
    assert not compute or out[1] == "[1.0, 1.0]", out


@pytest.mark.slow
def test_wheel_and_sdist_contents(dists):
    wheel, sdist = dists
    version = gradcomm.__version__
    assert wheel.name == f"gradcomm-{version}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"gradcomm/py.typed", "gradcomm/__init__.py", "gradcomm/perfmodel/__init__.py"} <= names
    assert not [n for n in names if n.startswith(("tests/", "experiments/"))]
    # The experiments' shared package (experiments/gradcomm_experiments), imported by name.
    assert {"gradcomm_experiments/__init__.py", "gradcomm_experiments/network/worker.py"} <= names
    metadata = zipfile.ZipFile(wheel).read(f"gradcomm-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in metadata
    assert sdist.name == f"gradcomm-{version}.tar.gz"
    names = set(tarfile.open(sdist).getnames())
    assert {f"gradcomm-{version}/{n}" for n in ("pyproject.toml", "gradcomm/py.typed")} <= names


# The install cell's three cases run in one test, one after the other in one fresh venv:
# making the venv takes longer than the three together, and two tests on two pytest-xdist
# workers would make one each.
@pytest.mark.slow
def test_install_cell_in_a_fresh_venv(dists, venv, tmp_path):
    """With nothing to install from, the cell says what to do and installs nothing; it
    installs the wheel it finds and keeps jax (then does nothing); it installs the sdist
    that GRADCOMM_SOURCE names."""
    wheel, sdist = dists
    install_cell_explains_what_to_do(venv, tmp_path / "explains")
    install_cell_installs_the_wheel_and_keeps_jax(wheel, venv, tmp_path / "wheel")
    install_cell_installs_the_sdist(sdist, venv, tmp_path / "sdist")


def install_cell_explains_what_to_do(venv, tmp_path):
    without_gradcomm(venv)
    cell = install_cell()
    (minimum,) = re.findall(r'^JAX_MINIMUM = "([^"]+)"', cell, re.M)

    # A runtime whose jax is older than gradcomm's minimum: told how to upgrade, nothing installed.
    old = cell.replace(f'JAX_MINIMUM = "{minimum}"', 'JAX_MINIMUM = "99.0.0"')
    result = run_install_cell(venv, tmp_path, source=old)
    assert result.returncode != 0
    assert f"This runtime has jax {JAX} and jaxlib {JAXLIB}; gradcomm needs jax>=99.0.0" in (
        result.stderr
    )
    assert '!pip install -U "jax[cuda12]>=99.0.0"' in result.stderr
    assert "Restart session" in result.stderr

    # Nothing to install from: says how to bring a wheel or a checkout.
    result = run_install_cell(venv, tmp_path)
    assert result.returncode != 0
    assert "no checkout or wheel of it" in result.stderr
    assert "python -m build" in result.stderr
    result = run_install_cell(venv, tmp_path, env={"GRADCOMM_SOURCE": str(tmp_path / "nothere")})
    assert result.returncode != 0
    assert "nothere', which does not exist" in result.stderr

    assert_not_installed(venv)


def install_cell_installs_the_wheel_and_keeps_jax(wheel, venv, tmp_path):
    without_gradcomm(venv)
    (tmp_path / "work" / "notebook").mkdir(parents=True)
    uploaded = shutil.copy(wheel, tmp_path / "work" / "notebook")  # found by the cell's search
    result = run_install_cell(venv, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Installing gradcomm from {uploaded}, keeping jax=={JAX} and jaxlib=={JAXLIB}" in (
        result.stdout
    )
    check_installed(venv, tmp_path, compute=True)
    again = run_install_cell(venv, tmp_path)  # where gradcomm imports, the cell does nothing
    assert again.returncode == 0
    assert again.stdout == "gradcomm is already importable here: nothing to install.\n"


def install_cell_installs_the_sdist(sdist, venv, tmp_path):
    without_gradcomm(venv)
    result = run_install_cell(venv, tmp_path, env={"GRADCOMM_SOURCE": str(sdist)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Installing gradcomm from {sdist}" in result.stdout
    check_installed(venv, tmp_path)


def test_version_has_one_source():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradcomm.__version__"}
    assert not re.search(r'^version\s*=\s*"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", gradcomm.__version__)
    assert importlib.metadata.version("gradcomm") == gradcomm.__version__


def test_citation_cff_is_valid_and_cites_every_methods_paper(tmp_path):
    cffconvert = shutil.which("cffconvert", path=str(pathlib.Path(sys.executable).parent))
    cffconvert = cffconvert or shutil.which("cffconvert") or pytest.skip("no cffconvert")
    yaml = pytest.importorskip("ruamel.yaml")  # cffconvert's own YAML reader
    citation = ROOT / "CITATION.cff"
    result = run([cffconvert, "--validate", "-i", citation])
    assert "valid" in result.stdout
    broken = tmp_path / "CITATION.cff"  # the validator does reject a bad file
    broken.write_text(citation.read_text() + "unknown-key: 1\n")
    assert run([cffconvert, "--validate", "-i", broken], check=False).returncode != 0

    data = yaml.YAML(typ="safe").load(citation.read_text())
    assert str(data["version"]) == gradcomm.__version__  # kept equal to the one source
    titles = [reference["title"] for reference in data["references"]]
    for words in (
        "Adaptive Summation",  # Adasum, Maleki et al., MLSys 2021
        "Layer-wise Adaptive Gradient Sparsification",  # LAGS-SGD, Shi et al., ECAI 2020
        "TernGrad",  # Wen et al., NeurIPS 2017
        "Stochastic Gradient Push",  # Assran et al., ICML 2019
        "Global Sparse Gradients with Local Gradients",  # gradient dropping, Aji et al., 2019
        "PowerSGD",  # Vogels et al., NeurIPS 2019
        "DiLoCo",  # Douillard et al., 2023
    ):
        assert sum(words in title for title in titles) == 1, words
    for reference in data["references"]:
        assert reference["authors"] and reference["year"], reference["title"]
