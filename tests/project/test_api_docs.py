"""The API reference builds strictly, renders signatures and maths, and quotes real figures.

`mkdocs build --strict` (mkdocs.yml, sources in docs/site/) fails on any warning, griffe's
docstring warnings included; the checks below read the built HTML and the guide's text.
"""

import html
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import zlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ROOT / "docs" / "site"
METHOD_PAGES = [
    "adasum",
    "lags",
    "terngrad",
    "gossip",
    "dropping",
    "dense",
    "powersgd",
    "low_precision",
    "diloco",
]
API_PAGES = ["parallel", "wire", "sparse", "perfmodel"]
# The files the guide may quote figures from.
QUOTED = [
    "README.md",
    "docs/site/guide/reproducing.md",
    "docs/site/guide/network.md",
    "docs/site/guide/costs.md",
    "docs/results.md",
    "docs/results/compare.md",
    "docs/bench/network.md",
    "docs/bench/peer/network.md",
    "docs/bench/model.md",
    "docs/bench/diloco_family/network.md",
    "docs/results/diloco_family.md",
]

_MISSING = [
    name
    for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    if importlib.util.find_spec(name.split(".")[0]) is None
    or importlib.util.find_spec(name) is None
]


@pytest.fixture(scope="module")
def site(build_once):
    """The built site, once per test session (`build_once`, tests/conftest.py)."""
    if _MISSING:
        pytest.skip(
            f"the docs toolchain is not installed (missing {', '.join(_MISSING)}); "
            'pip install -e ".[test]" installs mkdocs-material and mkdocstrings[python]'
        )

    def build(out):
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml"]
        result = subprocess.run(
            [*command, "-d", str(out)], cwd=ROOT, capture_output=True, text=True, env=env
        )
        assert result.returncode == 0, result.stdout + result.stderr

    return build_once("site", build)


def _page(site, path):
    page = site / path / "index.html"
    assert page.is_file(), f"{path} was not built"
    return page.read_text()


def _inventory(site):
    """Object names from mkdocstrings' Sphinx inventory (objects.inv, version 2)."""
    data = (site / "objects.inv").read_bytes()
    body = zlib.decompress(data.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def test_method_pages_render_signatures_and_maths(site):
    adasum = _page(site, "methods/adasum")
    anchor = adasum.index('id="gradcomm.adasum.adasum"')
    signature = re.search(r'<div class="doc-signature[^"]*">(.*?)</div>', adasum[anchor:], re.S)
    assert signature, "gradcomm.adasum has no rendered signature"
    text = html.unescape(re.sub(r"<[^>]+>", "", signature.group(1)))
    assert re.match(r"\s*adasum\(\s*axis_name: AxisName = \"data\",", text), text
    assert 'exchange: Exchange = "auto"' in text and "GradientTransformationExtraArgs" in text
    maths = re.findall(r'<div class="arithmatex">(.*?)</div>', adasum, re.S)
    assert any(r"\operatorname{AS}(a, b)" in m for m in maths), "eq. 8 is not rendered"
    # The doctests render as code, not as quoted prose.
    assert '<span class="gp">&gt;&gt;&gt; </span>' in adasum
    assert "<blockquote>" not in adasum
    for name in METHOD_PAGES:
        page = _page(site, f"methods/{name}")
        assert 'class="arithmatex"' in page, f"methods/{name} renders no equation"
        assert 'class="doc-signature' in page, f"methods/{name} renders no signature"
    for name in API_PAGES:
        assert f'id="gradcomm.{name}"' in _page(site, f"api/{name}")


def test_every_public_name_is_documented(site):
    import importlib

    import gradcomm

    # `gradcomm.lags` is the function; the module is gradcomm.lags in sys.modules.
    modules = ["lags", "parallel", "perfmodel", "sparse", "wire"]
    modules = [gradcomm] + [importlib.import_module(f"gradcomm.{m}") for m in modules]
    documented = _inventory(site)
    text = "".join(p.read_text() for p in site.rglob("index.html"))
    missing = []
    for module in modules:
        for name in module.__all__:
            if f"{module.__name__}.{name}" in documented or any(
                n.startswith("gradcomm.") and n.endswith(f".{name}") for n in documented
            ):
                continue
            if module is not gradcomm and f"<code>{name}</code>" in text:
                continue  # a constant or type alias, described in the page's prose
            missing.append(f"{module.__name__}.{name}")
    assert not missing, f"not in the API reference: {missing}"


def test_results_pages_are_served(site):
    guide = _page(site, "choosing")
    for target in ("results/compare/", "bench/network/", "bench/model/", "results/"):
        assert f'href="../{target}"' in guide, target
    assert "<img" in _page(site, "results")  # the studies' plots came along


def _numbers(text):
    return set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.]*\d)", text))


def test_guide_quotes_only_committed_figures():
    guide = (SOURCES / "choosing.md").read_text()
    quoted = "\n".join((ROOT / path).read_text() for path in QUOTED)
    unknown = sorted(_numbers(guide) - _numbers(quoted))
    assert not unknown, f"choosing.md quotes figures found in none of {QUOTED}: {unknown}"


def test_guide_network_table_matches_the_benchmark():
    """Each cell of the guide's step-time table is the one in docs/bench/network.md."""
    bench = (ROOT / "docs/bench/network.md").read_text()
    ratios = {}
    for n, table in re.findall(r"\*\*N = (\d+)\*\*\n\n(.*?)(?:\n\n|\Z)", bench, re.S):
        for row in table.splitlines()[2:]:
            cells = [c.strip() for c in row.strip("|").split("|")]
            ratios[cells[0], int(n)] = [c.split()[0] for c in cells[1:4]]
    assert ratios, "docs/bench/network.md has no per-N tables"
    guide = (SOURCES / "choosing.md").read_text()
    head = "| method | N = 2, 100 Mbit | N = 4, 100 Mbit |"
    rows = guide[guide.index(head) :].split("\n\n")[0].splitlines()[2:]
    assert rows
    for row in rows:
        method, *cells = [c.strip() for c in row.strip("|").split("|")]
        n2, n4 = ratios[method, 2], ratios[method, 4]
        assert cells == [n2[0], n4[0], n2[1], n4[1], n2[2], n4[2]], method
