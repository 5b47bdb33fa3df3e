"""The docstring examples run, and the code is ruff clean."""

import doctest
import importlib
import pathlib
import pkgutil
import shutil
import subprocess
import sys

import pytest
from helpers import result_records

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Every module of the library, packages' private ones included (perfmodel's in
# tests/library/test_perfmodel.py): doctest finds an object's example only in the module that
# defines it.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages([str(ROOT / "gradcomm")], "gradcomm.")
    if not m.name.startswith("gradcomm.perfmodel")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_every_public_function_shows_an_example():
    """Each function a public module offers, wherever it is defined, carries a run example."""
    missing = []
    for name in ["gradcomm", *MODULES]:
        if any(part.startswith("_") for part in name.split(".")):
            continue
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", dir(module)):
            obj = getattr(module, attr)
            defined = getattr(obj, "__module__", None) or ""
            if attr.startswith("_") or not callable(obj) or not defined.startswith("gradcomm"):
                continue
            doc = obj.__doc__ or ""
            if "Args:" in doc and ">>>" not in doc:
                missing.append(f"{name}.{attr}")
    assert not missing, f"public functions without an example: {missing}"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    ruff = shutil.which("ruff") or pytest.skip("ruff is not installed")
    dirs = [str(ROOT / d) for d in ("gradcomm", "tests", "experiments", "colab")]
    result = subprocess.run([ruff, *command, *dirs], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_public_api_is_exported():
    import gradcomm

    for name in gradcomm.__all__:
        assert hasattr(gradcomm, name), name
    assert sys.modules["gradcomm.adasum"].adasum is gradcomm.adasum


def _python_blocks(path):
    import re

    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


def test_readme_python_examples_run():
    blocks = _python_blocks("README.md")
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


# The docs pages that hold runnable recipes (most moved out of the README): every ```python
# block runs as written; a fragment that is not meant to run uses another fence (```py).
DOCS_WITH_EXAMPLES = [
    "docs/site/index.md",
    "docs/site/guide/training.md",
    "docs/site/guide/wire.md",
    "docs/site/sharded.md",
]


@pytest.mark.parametrize("path", DOCS_WITH_EXAMPLES)
def test_docs_python_examples_run(path):
    blocks = _python_blocks(path)
    assert blocks, f"{path} has no ```python block"
    for block in blocks:
        exec(compile(block, path, "exec"), {})


def test_every_committed_result_says_what_made_it():
    """Each JSON under docs/, and the packaged GPU kernel record under gradcomm/, carries a
    provenance record with every key (per record, for a list of records or a dict of
    `"records"` and figures made from them); results made before records existed say so
    in `backfilled`."""
    import json

    from gradcomm_experiments import provenance

    files = sorted((ROOT / "docs").rglob("*.json")) + sorted((ROOT / "gradcomm").rglob("*.json"))
    assert files and ROOT / "gradcomm/perfmodel/kernels_gpu/bench_kernels.json" in files
    for path in files:
        data = json.loads(path.read_text())
        for record in result_records(data):
            prov = record.get("provenance")
            assert isinstance(prov, dict), f"{path.relative_to(ROOT)}: no provenance"
            missing = set(provenance.KEYS) - set(prov)
            assert not missing, f"{path.relative_to(ROOT)}: provenance lacks {missing}"
            made_here = prov["git_commit"] != "unknown" or "backfilled" in prov
            assert made_here, f"{path.relative_to(ROOT)}: neither a commit nor a note"


def test_the_layout_shows_the_architecture():
    """No module over 400 lines; a private module stays at the top of the package only if
    two or more modules import it (else it lives in its method's package)."""
    import re

    sources = {p: p.read_text() for p in (ROOT / "gradcomm").rglob("*.py")}
    long = [str(p.relative_to(ROOT)) for p, text in sources.items() if text.count("\n") > 400]
    assert not long, f"over 400 lines: {long}"
    for path in (ROOT / "gradcomm").glob("_*.py"):
        if path.name == "__init__.py":
            continue
        name = path.stem
        users = [p for p, text in sources.items() if p != path and re.search(rf"\b{name}\b", text)]
        assert len(users) >= 2, f"gradcomm/{path.name} has one user: move it into its package"
    scripts = [*(ROOT / "experiments").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    edits = [str(p) for p in scripts if "sys.path." + "insert" in p.read_text()]
    assert not edits, f"import the shared package by name, no sys.path edits: {edits}"
