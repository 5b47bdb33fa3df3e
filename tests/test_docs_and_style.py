"""The docstring examples run, and the code is ruff clean."""

import doctest
import importlib
import pathlib
import pkgutil
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
# Every module of the library (perfmodel's in tests/test_perfmodel.py): doctest finds an
# object's example only in the module that defines it.
MODULES = sorted(
    f"gradcomm.{m.name}"
    for m in pkgutil.iter_modules([str(ROOT / "gradcomm")])
    if m.name != "perfmodel"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    public = [
        getattr(module, n)
        for n in dir(module)
        if not n.startswith("_")
        and callable(getattr(module, n))
        and getattr(getattr(module, n), "__module__", None) == name
        and (getattr(module, n).__doc__ or "").count("Args:")
    ]
    if public and not name.split(".")[-1].startswith("_"):  # a public module shows them run
        assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


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
    """Each JSON under docs/ carries a provenance record with every key (per record, for
    a list of records); results made before records existed say so in `backfilled`."""
    import json

    sys.path.insert(0, str(ROOT / "experiments"))
    import _provenance

    files = sorted((ROOT / "docs").rglob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else [data]
        for record in records:
            prov = record.get("provenance")
            assert isinstance(prov, dict), f"{path.relative_to(ROOT)}: no provenance"
            missing = set(_provenance.KEYS) - set(prov)
            assert not missing, f"{path.relative_to(ROOT)}: provenance lacks {missing}"
            made_here = prov["git_commit"] != "unknown" or "backfilled" in prov
            assert made_here, f"{path.relative_to(ROOT)}: neither a commit nor a note"
