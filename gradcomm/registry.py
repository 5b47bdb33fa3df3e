"""The methods, one entry each: the registry that the docs, the step-time model and the
benchmarks read.

Each method's module registers its entry when gradcomm is imported (`register`, at the
bottom of the module): the factory, where the transformation goes in a chain, its paper,
its docs page, and the collectives one step runs, which `gradcomm.perfmodel` times. The
README's methods table and the docs' index are `markdown_table()` (a test holds the README
to it; the docs build writes it), and the experiments' method list starts from
`METHODS`. A new method is then its module (factory, state, entry), its test file, its
line in `gradcomm/__init__.py` and its row in the README.

Example:
  >>> from gradcomm import registry
  >>> registry.METHODS["adasum"].placement
  'after'
  >>> registry.METHODS["terngrad"].where()
  'before the optimizer'
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gradcomm.perfmodel import Collective, Setting, Window

Placement = Literal["before", "after", "either", "params", "optimizer"]
_WHERE = {
    "before": "before the optimizer",
    "after": "after the optimizer",
    "either": "before or after the optimizer",
    "params": "on the params (`train_step(..., sync=...)`)",
    "optimizer": "in place of the optimizer",
}


@dataclasses.dataclass(frozen=True)
class Method:
    """One method as the library describes it.

    Attributes:
      factory: the public factory, `gradcomm.<name>`; its name is the method's.
      placement: where it goes: "before" the optimizer (on gradients), "after" it (on the
        optimizer's updates), "either", or "params": a `gradcomm.ParamsSync` that
        `parallel.train_step` runs on the params after each step, or "optimizer": it is
        the optimizer (it takes the learning rate).
      title: the method's name in prose ("Adasum").
      paper: its reference, "Maleki et al., MLSys 2021", or "baseline".
      page: its docs page, `docs/site/methods/<page>.md`.
      collectives: `collectives(options, setting) -> list[perfmodel.Collective]`: what
        one step sends, for the factory's keyword arguments `options` (defaults filled
        in) in a `perfmodel.Setting`.
      window: where its communication can hide behind compute (`perfmodel.Window`), or a
        function of the options that says.
      per_device: whether devices hold different params (gossip, local SGD, DiLoCo).
    """

    factory: Callable[..., Any]
    placement: Placement
    title: str
    paper: str
    page: str
    collectives: Callable[[Mapping[str, Any], Setting], list[Collective]]
    window: Window | Callable[[Mapping[str, Any]], Window] = "none"
    per_device: bool = False

    @property
    def name(self) -> str:
        """The factory's name: `gradcomm.<name>`."""
        return self.factory.__name__

    def options(self, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The factory's keyword arguments: its defaults, updated with `given`.

        Raises:
          ValueError: for an option the factory does not take.
        """
        signature = inspect.signature(self.factory).parameters
        unknown = sorted(set(given or {}) - set(signature))
        if unknown:
            raise ValueError(
                f"{self.name} takes no option {', '.join(map(repr, unknown))}; its options "
                f"are {', '.join(p for p in signature if p != 'axis_name')}"
            )
        defaults = {k: p.default for k, p in signature.items() if p.default is not p.empty}
        return {**defaults, **(given or {})}

    def where(self) -> str:
        """Where it goes, in words (the methods table's last column)."""
        per_device = self.per_device and self.placement != "params"  # a sync: said already
        return _WHERE[self.placement] + (", per-device params" if per_device else "")

    def hides_in(self, options: Mapping[str, Any] | None = None) -> Window:
        """Where its communication can hide, for these options."""
        if callable(self.window):
            return self.window(self.options(options))
        return self.window


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Adds `method` to `METHODS` under its factory's name, and returns it.

    Raises:
      ValueError: where another method has that name already.
    """
    known = METHODS.get(method.name)
    if known is not None and known.factory is not method.factory:
        raise ValueError(f"a method named {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


def markdown_table(links: str | None = None, signatures: bool = False) -> str:
    """The methods table, one row per registered method: the baselines, then by year.

    Args:
      links: add a column linking each method's docs page, `<links>methods/<page>.md`
        (`""` from the docs' top folder); None: no links (the README's table).
      signatures: write each factory with its signature.

    Returns:
      A Markdown table: method, paper, factory and where it goes.

    Example:
      >>> from gradcomm import registry
      >>> print(registry.markdown_table().splitlines()[2])
      | All-reduce | baseline | `allreduce` | before or after the optimizer |
    """
    head = ["method", "paper", "factory", "where it goes"] + (["page"] if links is not None else [])
    rows = [head, ["---"] * len(head)]
    for m in sorted(METHODS.values(), key=_order):
        factory = f"gradcomm.{m.name}{_signature(m.factory)}" if signatures else m.name
        row = [m.title, m.paper, f"`{factory}`", m.where()]
        if links is not None:
            row.append(f"[{m.page}]({links}methods/{m.page}.md)")
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _order(m: Method) -> tuple[bool, str, str]:
    """The baselines first, then by the paper's year (the last word that is a year)."""
    years = [w for w in m.paper.replace(",", " ").split() if w.isdigit()]
    return (m.paper != "baseline", years[-1] if years else "9999", m.title.lower())


def _signature(factory: Callable[..., Any]) -> str:
    """`(axis_name, density=0.001, ...)`: the factory's arguments as a user writes them."""
    parts = []
    for name, p in inspect.signature(factory).parameters.items():
        if p.default is p.empty:
            parts.append(name)
        elif name != "axis_name":
            default = getattr(p.default, "__name__", None) or repr(p.default)
            parts.append(f"{name}={default}")
    return "(" + ", ".join(["axis_name", *parts]) + ")"
