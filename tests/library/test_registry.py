"""The registry: one entry per method, read by the docs, the step-time model and the studies."""

import importlib
import inspect
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest

import gradcomm
from gradcomm import perfmodel, registry

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Public factories that wrap a method rather than being one.
WRAPPERS = {"apply_if_finite"}


def _makes_a_method(obj: Any) -> bool:
    returns = str(inspect.signature(obj).return_annotation)
    return "GradientTransformation" in returns or "ParamsSync" in returns


def test_every_public_factory_is_registered():
    factories = {
        name
        for name in gradcomm.__all__
        if inspect.isfunction(getattr(gradcomm, name)) and _makes_a_method(getattr(gradcomm, name))
    }
    assert factories - WRAPPERS == set(registry.METHODS)
    for name, entry in registry.METHODS.items():
        assert getattr(gradcomm, name) is entry.factory


def test_the_readme_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    assert registry.markdown_table() in readme, "rewrite the README's table: markdown_table()"


@pytest.mark.parametrize("name", sorted(registry.METHODS))
def test_each_entry_has_a_page_a_pattern_and_a_window(name):
    entry = registry.METHODS[name]
    page = ROOT / "docs" / "site" / "methods" / f"{entry.page}.md"
    module = importlib.import_module(entry.factory.__module__)
    assert page.is_file() or module.__doc__, "the docs make its page from its module's docstring"
    home = entry.factory.__module__.split(".")[1]  # gradcomm.<home>[._private]
    assert (ROOT / "tests" / "methods" / f"test_{home}.py").is_file(), "its test file"
    collectives = perfmodel.pattern(name, 4096, 4)
    assert collectives and sum(c.sent() for c in collectives) > 0
    assert perfmodel.pattern(name, 4096, 1) == []
    assert perfmodel.window(name) in ("backward", "step", "none")


def test_an_unknown_option_names_the_factorys_options():
    with pytest.raises(ValueError, match="gradient_dropping takes no option 'average_every'"):
        perfmodel.pattern("gradient_dropping", 10, 2, options={"average_every": 50})
    with pytest.raises(ValueError, match="unknown sync"):
        perfmodel.pattern("lags", 10, 2, sync={"name": "lags"})


class HalfState(NamedTuple):
    """The toy method's state: none."""


def half_mean(axis_name: str = "data") -> optax.GradientTransformationExtraArgs:
    """A toy method: the mean of the updates, halved (an all-reduce)."""

    def update(updates: Any, state: HalfState, params: Any = None) -> tuple[Any, HalfState]:
        del params
        return jax.tree.map(lambda u: jax.lax.pmean(u, axis_name) / 2, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: HalfState(), update)


def _other_half_mean():
    def half_mean() -> None:  # another factory of the same name
        pass

    return half_mean


def test_a_new_method_is_one_entry_away_from_the_model_the_docs_and_the_studies():
    """What a contributor writes in the method's module, and what then reads it."""

    def collectives(options: Any, s: perfmodel.Setting) -> list[perfmodel.Collective]:
        return [perfmodel.Collective("allreduce", s.nodes, s.size)]

    entry = registry.Method(half_mean, "after", "Half mean", "baseline", "dense", collectives)
    registry.register(entry)
    try:
        other = registry.Method(_other_half_mean(), "after", "x", "y", "z", collectives)
        with pytest.raises(ValueError, match="registered already"):
            registry.register(other)
        assert "| Half mean | baseline | `half_mean` | after the optimizer |" in (
            registry.markdown_table()
        )
        model = perfmodel.predict("half_mean", 1000, 4, bandwidth=1.0)
        assert model.wire_bytes == perfmodel.predict("allreduce", 1000, 4, bandwidth=1.0).wire_bytes
        methods = pytest.importorskip("gradcomm_experiments.methods")
        spec = methods.specs()["half_mean"]
        tx = methods.build(spec, optax.sgd(1.0)).tx
        g = jnp.array([[2.0], [4.0]])
        out = jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="data")(g)
        assert out.tolist() == [[-1.5], [-1.5]]
    finally:
        del registry.METHODS["half_mean"]
