"""The methods by name: the one registry that compare.py, the network benchmark and the model read.

A display name ("allreduce", "lags-0.001", "dropping-local", ...) maps to a `Spec`, plain
data: the gradcomm factory that makes the method, its keyword arguments, and the
`gradcomm.ParamsSync` that `parallel.train_step` runs after each step (if any). Where the
transformation goes in the chain, and whether devices hold different params, are the
method's entry in `gradcomm.registry`; every registered method that no spec here runs is
added under its factory's name (`specs`). `build` turns a spec into the `Method` the
training loop runs; `Spec.describe()` is what the network benchmark writes into
network.json and what `gradcomm.perfmodel` reads (`crossover_table(..., methods=rows())`),
so the three speak one vocabulary.

Each method goes where its paper puts it: the all-reduce before the optimizer (it averages
gradients), Adasum after it (it combines each device's update, paper A.6), TernGrad before
it (it quantizes gradients), LAGS and SLGS after it (they sparsify learning-rate-scaled
updates, LAGS eq. 5), gradient dropping before it (Algorithm 1 feeds the optimizer), and
the gossip methods (SGP, 1-overlap SGP, D-PSGD) after it. PowerSGD goes before it (its
Algorithm 2 compresses the gradient and feeds the optimizer), and so do the 16-bit
all-reduces (PyTorch's fp16 and bf16 hooks average gradients). Local SGD is the plain
optimizer with `gradcomm.local_sgd`'s sync, DiLoCo the plain (inner) optimizer with
`gradcomm.diloco`'s outer step as its sync (Streaming DiLoCo likewise), and gradient
dropping with local gradients averages the params with `gradcomm.periodic_average`. 1-bit
Adam is the optimizer: it replaces the inner one, at the rate `build` passes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from gradcomm import registry

if TYPE_CHECKING:
    import optax

    import gradcomm


@dataclasses.dataclass(frozen=True)
class Spec:
    """A method as plain data.

    Attributes:
      label: the display name.
      method: the gradcomm factory, called as `gradcomm.<method>(axis, **options)`. Local
        SGD's, `local_sgd`, and DiLoCo's, `diloco`, make a `ParamsSync`: the method is
        then the plain optimizer and that sync.
      options: the factory's keyword arguments.
      sync: the `ParamsSync` run after each step, as its factory's name and keyword
        arguments (`{"name": "periodic_average", "every": 50}`); None for none.
      local: whether it averages over a host's devices first (`local_axis="local"`): the
        network benchmark runs it with 2 devices per host.
    """

    label: str
    method: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sync: Mapping[str, Any] | None = None
    local: bool = False

    @property
    def first(self) -> bool:
        """Whether the transformation goes before the inner optimizer (on gradients) rather
        than after it (on the optimizer's updates): its registry entry's placement."""
        return registry.METHODS[self.method].placement in ("before", "either")

    @property
    def per_device(self) -> bool:
        """Whether devices hold different params: the method's, or its sync's, entry says."""
        syncs = [] if self.sync is None else [registry.METHODS[self.sync["name"]]]
        return any(m.per_device for m in (registry.METHODS[self.method], *syncs))

    def describe(self) -> dict[str, Any]:
        """The method as network.json records and `gradcomm.perfmodel` name it."""
        return {
            "method": self.method,
            "options": dict(self.options),
            "sync": None if self.sync is None else dict(self.sync),
            "label": self.label,
        }

    def configured(self, *, sync_every: int | None = None, **options: Any) -> Spec:
        """This method with `options` set on its factory and, with `sync_every`, its sync's
        period (a method without a sync has none to set)."""
        sync = self.sync
        if sync_every is not None:
            if sync is None:
                raise ValueError(f"{self.label} has no sync whose period to set")
            sync = {**sync, "every": sync_every}
        return dataclasses.replace(self, options={**self.options, **options}, sync=sync)

    @property
    def every(self) -> int | None:
        """The steps between parameter averages (its sync's, local SGD's or DiLoCo's); None:
        none."""
        if self.sync is not None:
            return self.sync["every"]
        if registry.METHODS[self.method].placement == "params":
            return registry.METHODS[self.method].options(self.options)["every"]
        return None


_AVERAGE = {"name": "periodic_average", "every": 50}
_DROP = {"warmup_steps": 50}
_HIERARCHICAL = {"local_axis": "local"}
_PERMUTE = {"exchange": "permute"}
_PAIRWISE = {"exchange": "pairwise"}
# fmt: off
_SPECS = (
    Spec("allreduce", "allreduce"),
    Spec("adasum", "adasum"),
    Spec("adasum-hierarchical", "adasum", _HIERARCHICAL, local=True),
    # The swaps both ways, of which "auto" takes the faster on the link (its probe,
    # `parallel.calibrate`): ppermutes (half speed on gloo's slow links, less CPU) and
    # two-member reduce-scatters (full speed both ways).
    Spec("adasum-permute", "adasum", _PERMUTE),
    Spec("adasum-pairwise", "adasum", _PAIRWISE),
    Spec("adasum-hierarchical-permute", "adasum", _HIERARCHICAL | _PERMUTE, local=True),
    Spec("adasum-hierarchical-pairwise", "adasum", _HIERARCHICAL | _PAIRWISE, local=True),
    Spec("terngrad", "terngrad"),
    Spec("lags", "lags", {"density": 0.01}),
    Spec("lags-0.001", "lags", {"density": 0.001}),
    Spec("slgs", "slgs", {"density": 0.01}),
    Spec("dropping", "gradient_dropping", _DROP),
    Spec("dropping-local", "gradient_dropping", {"local": "compensated", **_DROP}, _AVERAGE),
    Spec("local-sgd", "local_sgd", {"every": 20}),
    Spec("sgp", "sgp"),
    Spec("sgp-permute", "sgp", _PERMUTE),
    Spec("sgp-pairwise", "sgp", _PAIRWISE),
    Spec("osgp", "sgp", {"overlap": 1}),
    Spec("dpsgd", "dpsgd"),
    Spec("dpsgd-permute", "dpsgd", _PERMUTE),
    Spec("dpsgd-pairwise", "dpsgd", _PAIRWISE),
    Spec("powersgd", "powersgd", {"rank": 2}),
    Spec("fp16", "low_precision", {"dtype": "float16"}),
    # float16's other exchanges ("auto" on gloo is "pairwise" at N = 2, "ring" above): the
    # pairwise one at every N, one psum (gloo adds float16 slowly), and the bits through an
    # all_to_all and an all_gather ("fp16-bits": the label of the committed records, from
    # before that exchange was renamed "all_to_all").
    Spec("fp16-pairwise", "low_precision", {"dtype": "float16", "exchange": "pairwise"}),
    Spec("fp16-psum", "low_precision", {"dtype": "float16", "exchange": "psum"}),
    Spec("fp16-bits", "low_precision", {"dtype": "float16", "exchange": "all_to_all"}),
    Spec("bf16", "low_precision", {"dtype": "bfloat16"}),
    Spec("diloco", "diloco", {"every": 20}),
    Spec("diloco-eager", "diloco", {"every": 20, "eager": True}),
    # Streaming DiLoCo's defaults: 2 fragments, a delay of 1 step, 4-bit outer gradients.
    Spec("streaming-diloco", "streaming_diloco", {"every": 20}),
    Spec("streaming-diloco-f32", "streaming_diloco", {"every": 20, "outer_dtype": "float32"}),
    Spec("onebit-adam", "onebit_adam", {"warmup_steps": 100}),
)
# compare.py's methods: one of each kind, on the small CNN.
_COMPARE = ("allreduce", "adasum", "terngrad", "lags", "slgs", "dropping", "dropping-local",
            "local-sgd", "sgp", "osgp", "dpsgd", "powersgd", "fp16", "diloco",
            "streaming-diloco", "onebit-adam")
# fmt: on


def specs() -> dict[str, Spec]:
    """Every method by display name: the specs above, then each registered gradcomm method
    that none of them runs (as its method or its sync), under its factory's name with its
    factory's defaults."""
    runs = {s.method for s in _SPECS} | {s.sync["name"] for s in _SPECS if s.sync}
    new = [Spec(name, name) for name in registry.METHODS if name not in runs]
    return {s.label: s for s in (*_SPECS, *new)}


METHODS: dict[str, Spec] = specs()
# compare.py's methods: one of each kind (a newly registered method included).
COMPARE = _COMPARE + tuple(label for label in METHODS if label not in {s.label for s in _SPECS})
# The network benchmark's rows: every method.
NETWORK = tuple(METHODS)


def rows(names: Sequence[str] = NETWORK) -> list[dict[str, Any]]:
    """`Spec.describe()` of the named methods that run one device per host.

    These are the rows `gradcomm.perfmodel.crossover_table(..., methods=rows())` reads.
    """
    return [METHODS[n].describe() for n in names if not METHODS[n].local]


def parse(text: str) -> list[str]:
    """The comma-separated method names of a flag, each checked against the registry.

    Raises:
      ValueError: a name is not in the registry (the message lists the known ones), or
        there is none.
    """
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        shown = ", ".join(unknown) if unknown else "none given"
        raise ValueError(f"unknown method(s): {shown}; choose from {', '.join(METHODS)}")
    return names


@dataclasses.dataclass(frozen=True)
class Method:
    """A method as the training loop runs it.

    Attributes:
      name: the method's name.
      tx: the transformation, chained with the inner optimizer.
      per_device: whether devices hold different params (gossip, local SGD).
      sync: the `gradcomm.ParamsSync` that `parallel.train_step` runs after each step.
      compiled: where `start` keeps the jitted train steps it builds, by loss function,
        mesh and donation, to take them from again: several runs (seeds) of the method,
        one compiled step. None: a new step on every `start`.
    """

    name: str
    tx: optax.GradientTransformation
    per_device: bool = False
    sync: gradcomm.ParamsSync | None = None
    compiled: dict[Any, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def start(
        self,
        loss_fn: Any,
        mesh: Any,
        host_params: Any,
        *,
        donate: bool = False,
        metrics: Literal["mean", "per_device"] = "mean",
    ) -> tuple[Any, Any, Any]:
        """`(params, state, step)`: the params placed on `mesh`, the state and the jitted step.

        `loss_fn(params, batch) -> (loss, metrics)`; `host_params` one copy of the params;
        `metrics` as `parallel.train_step`'s.
        """
        from gradcomm import parallel

        place = parallel.per_device if self.per_device else parallel.replicate
        params = place(host_params, mesh)
        kw: dict[str, Any] = {"params_per_device": self.per_device, "sync": self.sync}
        state = parallel.init_state(self.tx, params, mesh, **kw)
        key = (loss_fn, mesh, donate, metrics)
        step = None if self.compiled is None else self.compiled.get(key)
        if step is None:
            step = parallel.train_step(
                loss_fn, self.tx, mesh, has_aux=True, donate=donate, metrics=metrics, **kw
            )
            if self.compiled is not None:
                self.compiled[key] = step
        return params, state, step


def build(
    spec: Spec | str,
    opt: optax.GradientTransformation,
    axis: Any = "data",
    learning_rate: optax.ScalarOrSchedule | None = None,
) -> Method:
    """The method `spec` (or the registry's method of that name) with the inner optimizer.

    Args:
      spec: a `Spec`, or a name in `METHODS`.
      opt: the inner optimizer; a method that is the optimizer (1-bit Adam, placement
        "optimizer") replaces it.
      axis: the mesh axis (or tuple of axes) the method communicates over.
      learning_rate: the rate (or schedule) of a method that replaces the optimizer, where
        its spec sets none (default: the factory's); ignored by the others.

    Returns:
      A `Method` named by the spec's label.
    """
    import optax

    import gradcomm

    spec = METHODS[spec] if isinstance(spec, str) else spec
    options = dict(spec.options)
    replaces = registry.METHODS[spec.method].placement == "optimizer"
    if replaces and learning_rate is not None:
        options.setdefault("learning_rate", learning_rate)
    made = registry.METHODS[spec.method].factory(axis, **options)
    sync = None
    if spec.sync is not None:
        kwargs = {k: v for k, v in spec.sync.items() if k != "name"}
        sync = registry.METHODS[spec.sync["name"]].factory(axis, **kwargs)
    if isinstance(made, gradcomm.ParamsSync):  # local SGD: the plain optimizer, then the sync
        tx, sync = opt, made
    elif replaces:
        tx = made
    else:
        tx = optax.chain(made, opt) if spec.first else optax.chain(opt, made)
    return Method(spec.label, tx, spec.per_device, sync)


def optimizer(
    name: str, lr: float, steps: int, schedule: str = "cosine"
) -> optax.GradientTransformation:
    """The inner optimizer: "adam", "sgd" or "momentum" (SGD with momentum 0.9), at
    `rate(lr, steps, schedule)`."""
    import optax

    rate = learning_rate(lr, steps, schedule)
    if name == "adam":
        return optax.adam(rate)
    if name == "sgd":
        return optax.sgd(rate)
    if name == "momentum":
        return optax.sgd(rate, momentum=0.9)
    raise SystemExit(f"unknown optimizer {name!r}: choose adam, sgd or momentum")


def learning_rate(lr: float, steps: int, schedule: str = "cosine") -> optax.ScalarOrSchedule:
    """`lr` on `schedule`: "cosine" (decay to 0 over `steps`) or "constant"."""
    import optax

    if schedule == "cosine":
        return optax.cosine_decay_schedule(lr, max(steps, 1))
    if schedule == "constant":
        return lr
    raise SystemExit(f"unknown schedule {schedule!r}: choose cosine or constant")
