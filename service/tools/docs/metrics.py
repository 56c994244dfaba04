"""docs/reference/metrics.md: every metric a service exposes on `/metrics`, its type, labels and
help. Names, types and help come from the objects the scrape reads: the `Metrics` registry and
each collector of `kvhandoff.service.observability.metrics`, built over empty inputs (a collector's
families exist whatever its numbers); the label names from the calls that declare them."""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvhandoff.service.http.app import VERSION
from kvhandoff.service.observability import metrics as source
from kvhandoff.service.observability.loop_stalls import LoopStalls


def metrics_page() -> str:
    out = [
        "# Metrics",
        "",
        "Generated from `service/observability/metrics.py` (and `loop_stalls.py`, an embedded "
        "service's only) by `python -m kvhandoff.service.tools.docs`; "
        "do not edit by hand. What to watch and the Grafana dashboard: "
        "[Metrics](../operations/metrics.md). A counter is exposed with `_total` appended, a "
        "histogram as `_bucket`, `_sum` and `_count`.",
        "",
        "| metric | type | labels | help |",
        "|---|---|---|---|",
    ]
    for family, labels in _families():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        cells = [
            f"`{name}`",
            family.type,
            ", ".join(f"`{x}`" for x in labels),
            family.documentation,
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _families() -> list[tuple[Metric, tuple[str, ...]]]:
    registry = source.Metrics("decode", VERSION)
    families = [*registry.registry.collect()]
    families += [f for collector in _collectors() for f in collector.collect()]
    embedded = CollectorRegistry()
    LoopStalls(embedded)  # registers its families there
    families += [*embedded.collect()]
    labels = _declared_labels()
    labels.update({m.name: m.labels for m in source.DEFINITIONS.values()})
    return [(f, labels.get(f.name, ())) for f in families]


def _declared_labels() -> dict[str, tuple[str, ...]]:
    """Each metric's label names as the source declares them outside `DEFINITIONS` (whose
    labels are read from it): a family with no series yet has
    no sample to read them from, and prometheus_client keeps them only in private attributes.
    A call whose first argument is the metric's name takes its labels from a `labels=` list or
    a third positional list, or from the local helper it calls (`gauge(name, doc)`)."""
    tree = ast.parse(inspect.getsource(source))
    helpers = {
        node.name: labels
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for ret in ast.walk(node)
        if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Call)
        if (labels := _labels_of(ret.value)) is not None
    }
    found: dict[str, tuple[str, ...]] = {}
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and call.args):
            continue
        name = call.args[0]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        labels = _labels_of(call)
        if labels is None and isinstance(call.func, ast.Name):
            labels = helpers.get(call.func.id)
        found[name.value] = labels or ()
    return found


def _labels_of(call: ast.Call) -> tuple[str, ...] | None:
    given = [k.value for k in call.keywords if k.arg in ("labels", "labelnames")]
    if len(call.args) > 2 and isinstance(call.args[2], ast.List):
        given.append(call.args[2])
    for node in given:
        if isinstance(node, ast.List):
            return tuple(str(e.value) for e in node.elts if isinstance(e, ast.Constant))
    return None


def _collectors() -> Iterable[Collector]:
    for _, cls in inspect.getmembers(source, inspect.isclass):
        if cls.__module__ == source.__name__ and Collector in cls.__mro__[1:]:
            hints = typing.get_type_hints(cls.__init__)
            hints.pop("return", None)
            yield typing.cast(Collector, cls(**{name: _empty(t) for name, t in hints.items()}))


def _empty(annotation: Any) -> Any:
    """An empty value of a collector's input: `Callable[[], X]` as a function returning X's."""
    origin = typing.get_origin(annotation)
    if origin is Callable:
        result = typing.get_args(annotation)[1]
        return lambda: _empty(result)
    return [] if origin is list else annotation()
