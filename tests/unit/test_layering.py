"""The layer rule, checked on the source: imports point one way only.

Across packages: `service → pipelines → transport`. Inside `pipelines/`, the two sides
(`pipelines/decode/`, `pipelines/prefill/`) import the shared modules beside them, never each
other; only `pipelines/inprocess.py`, which links the two in one process, imports both. Inside
`service/`: `cli → (tools, testing) → (serve, embedded) → api → runtime → observability →
peers → (http, records, webhooks) → (config, storage)`; a module may import its own layer or
any layer below it, never above. Walks every module's `import` statements with `ast` (function-local
imports included), so a lazy import cannot hide a backwards edge; the command line's modules,
imported by name when their command runs, are checked from its tables. No two modules import
each other, directly or around a longer circle (type-only imports included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("transport", "pipelines", "service")

#: Rank of each part; an import must not go to a higher rank. Top-level `service/*.py` modules
#: are listed by name; sub-packages by folder.
SERVICE_RANKS = {
    "config": 0,
    # The owner of background tasks (spawn, close with a bound): plain asyncio, used by all.
    "tasks": 0,
    # The one SQLite file under the decode's state directory, for records and the outbox alike.
    "storage": 0,
    "http": 1,
    # Handoff records and the webhook outbox and dispatcher, each over `storage`; the webhook
    # signature code is usable by the router client beside them.
    "records": 1,
    "webhooks": 1,
    # The router client: an HTTP library over the API's public schemas and the webhook
    # signature code (service/webhooks), usable by anything above; it knows no running service.
    "client": 1,
    "peers": 2,
    # Metrics, the dashboard's activity and the event stream's readers: they read peers and
    # webhooks, and the runtime and the API read them.
    "observability": 3,
    "runtime": 4,
    "api": 5,
    "serve": 6,
    "embedded": 6,
    # The multi-process deployment harness for tests, the demo and integrators' CI.
    "testing": 7,
    "tools": 7,
    # Engine adapters (the SGLang transfer backend): they run the embedded service.
    "integrations": 7,
    # The entry point: it imports each command's module by name, only when that command runs.
    "cli": 8,
}
PACKAGE_RANKS = {"transport": 0, "pipelines": 1, "service": 2}
#: The name the three folders install under (setup.py): `kvhandoff.service` is `service/`.
INSTALLED = "kvhandoff"
#: Top-level folders of the repository that the wheel does not install: a package module that
#: imported one would work from a checkout and fail where kvhandoff is installed.
NOT_INSTALLED = ("bench", "tests")


def _module_name(path: Path) -> str:
    return _module_name_in(ROOT, path)


def _parts(module: str) -> list[str]:
    """A module's name from its folder down: `kvhandoff.service.api` is service, api."""
    return module.removeprefix(f"{INSTALLED}.").split(".")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


#: The two sides of a handoff inside `pipelines/`: neither may import the other.
PIPELINE_SIDES = ("decode", "prefill")


def _pipelines_side(module: str) -> str | None:
    parts = _parts(module)
    if len(parts) > 1 and parts[0] == "pipelines" and parts[1] in PIPELINE_SIDES:
        return parts[1]
    return None


def _service_part(module: str) -> str | None:
    parts = _parts(module)
    return parts[1] if len(parts) > 1 and parts[0] == "service" else None


def _violations() -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            here = _module_name(path)
            here_pkg = _parts(here)[0]
            for line, target in _imports(path):
                target_pkg = _parts(target)[0]
                where = f"{path.relative_to(ROOT)}:{line} imports {target}"
                if target_pkg in NOT_INSTALLED:
                    bad.append(f"{where} ({target_pkg}/ is not installed with the package)")
                    continue
                if target_pkg in PACKAGE_RANKS:
                    if PACKAGE_RANKS[target_pkg] > PACKAGE_RANKS[here_pkg]:
                        bad.append(f"{where} ({here_pkg} may not import {target_pkg})")
                        continue
                elif target_pkg == "aiohttp" and here_pkg != "service":
                    bad.append(f"{where} (HTTP belongs to service/)")
                    continue
                side, other = _pipelines_side(here), _pipelines_side(target)
                if side and other and side != other:
                    bad.append(f"{where} (pipelines/{side} may not import pipelines/{other})")
                    continue
                src, dst = _service_part(here), _service_part(target)
                if here_pkg == "service" and target_pkg == "service" and src and dst:
                    if dst not in SERVICE_RANKS or src not in SERVICE_RANKS:
                        bad.append(f"{where} (part without a rank: add it to SERVICE_RANKS)")
                    elif SERVICE_RANKS[dst] > SERVICE_RANKS[src]:
                        bad.append(f"{where} (service/{src} may not import service/{dst})")
    return bad


def test_imports_point_one_way() -> None:
    assert _violations() == []


def test_the_command_line_imports_only_what_sits_below_it() -> None:
    from kvhandoff.service.cli import BENCHMARKS, COMMANDS

    modules = [module for module, _ in [*COMMANDS.values(), *BENCHMARKS.values()]]
    for module in modules:
        assert (ROOT / Path(*_parts(module))).with_suffix(".py").is_file(), module
        part = _parts(module)[1]
        assert SERVICE_RANKS[part] < SERVICE_RANKS["cli"], module


def test_the_demo_imports_no_benchmark() -> None:
    """The demo is what a new user runs first; a benchmark's helpers are free to change."""
    demo = ROOT / "service" / "tools" / "demo.py"
    assert [t for _, t in _imports(demo) if t.startswith("kvhandoff.service.tools.bench")] == []


def test_every_service_part_has_a_rank() -> None:
    parts = {p.stem if p.is_file() else p.name for p in (ROOT / "service").iterdir()}
    parts = {p for p in parts if not p.startswith(("_", ".")) and p not in ("py",)}
    parts.discard("py.typed")
    assert parts <= set(SERVICE_RANKS), parts - set(SERVICE_RANKS)


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        (
            "from kvhandoff.service.api.handoffs import x\n",
            "service/http may not import service/api",
        ),
        ("import kvhandoff.pipelines.decode\n", "transport may not import pipelines"),
        ("from bench.report import x\n", "bench/ is not installed with the package"),
        (
            "from kvhandoff.pipelines.prefill.handoff import x\n",
            "pipelines/decode may not import pipelines/prefill",
        ),
    ],
)
def test_the_checker_catches_a_backwards_import(
    source: str, expect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checker that cannot fail proves nothing: plant a backwards edge and expect it named.
    fake_root = tmp_path
    for package in PACKAGES:
        (fake_root / package).mkdir()
    (fake_root / "service" / "http").mkdir()
    (fake_root / "pipelines" / "decode").mkdir()
    if "service" in source:
        target = "service/http/app.py"
    elif "prefill" in source:
        target = "pipelines/decode/pipeline.py"
    else:
        target = "transport/base.py"
    (fake_root / target).write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    assert any(expect in v for v in _violations())


# ---------------------------------------------------------------------------------------------
# No import circle, of any length, anywhere (type-only imports count: a circle of types is still
# two modules that cannot be read, changed or tested one without the other)


def _graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of this tree it imports (`from a.b import c` names `a.b.c` when that
    is a module, else `a.b`)."""
    paths = {
        _module_name_in(root, p): p for package in PACKAGES for p in (root / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in paths
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            graph[module] |= {t for t in targets if t in paths and t != module}
    return graph


def _module_name_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([INSTALLED, *parts])


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert _circles(_graph(ROOT)) == []


def test_the_circle_check_can_fail(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "service" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvhandoff.service.b import "
        "B\n"
    )
    (tmp_path / "service" / "b.py").write_text("from kvhandoff.service import c\n")
    (tmp_path / "service" / "c.py").write_text("import kvhandoff.service.a\n")
    (tmp_path / "service" / "d.py").write_text("from kvhandoff.service.a import x\n")
    assert _circles(_graph(tmp_path)) == [
        ["kvhandoff.service.a", "kvhandoff.service.b", "kvhandoff.service.c"]
    ]


#: Top-level packages whose modules' private names (`_x`) are theirs alone.
OWN_PACKAGES = ("service", "pipelines", "transport", "tests")


def _private_imports(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        if ".venv" in path.parts or path.relative_to(root).parts[0] not in OWN_PACKAGES:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level != 0 or not node.module:
                continue
            if _parts(node.module)[0] not in OWN_PACKAGES:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{path.relative_to(root)}:{node.lineno} imports {alias.name}")
    return bad


def test_no_module_imports_another_module_s_private_names() -> None:
    # `from x import _y` couples two modules through what one of them may change at will: make
    # the name public where it is shared, or keep the code that needs it in its module.
    assert _private_imports(ROOT) == []


def test_the_private_import_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "a.py").write_text("from kvhandoff.service.b import _helper\n")
    assert _private_imports(tmp_path) == ["service/a.py:1 imports _helper"]


# ---------------------------------------------------------------------------------------------
# The service reads the pipelines through their query surface only


def _is_own(node: ast.expr) -> bool:
    """`self`, `cls` or `super()`: the code's own object, whose private names are its own."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    func = node.func if isinstance(node, ast.Call) else None
    return isinstance(func, ast.Name) and func.id == "super"


def _foreign_private_reads(root: Path) -> list[str]:
    # Private state (`_x`) of another object is its owner's to change at will: a service module
    # that reads a pipeline's `_handoffs` couples itself to how the pipeline keeps them.
    # An engine adapter (`service/integrations/`) is exempt: it patches the engine's closed
    # parts (SGLang's backend enum, its bootstrap registry's handlers), a contract with one
    # pinned engine version that its own tests check in that engine's environment.
    bad = []
    for path in sorted((root / "service").rglob("*.py")):
        if "integrations" in path.relative_to(root).parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not _is_own(node.value)
            ):
                bad.append(f"{path.relative_to(root)}:{node.lineno} reads {ast.unparse(node)}")
    return bad


#: Public attributes of a pipeline that are facts fixed at construction (or the one hook the
#: assembly sets), not state: the service may read them. Everything else it reads is a method.
PIPELINE_FACTS = frozenset(
    {"layout", "url", "target", "incarnation", "max_call_s", "on_peers", "query"}
)
PIPELINE_CLASSES = ("DecodePipeline", "PrefillPipeline")
#: How service code reaches a pipeline: the runtime's `.pipeline`, or a route's lookup.
PIPELINE_LOOKUPS = ("decode_of", "prefill_of")


def _pipeline_surface() -> set[str]:
    from kvhandoff.pipelines.decode import DecodePipeline
    from kvhandoff.pipelines.prefill import PrefillPipeline

    methods = {
        name
        for cls in (DecodePipeline, PrefillPipeline)
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name))
    }
    return methods | PIPELINE_FACTS


def _is_pipeline_annotation(node: ast.expr | None) -> bool:
    return node is not None and any(name in ast.unparse(node) for name in PIPELINE_CLASSES)


def _pipeline_names(tree: ast.AST) -> set[str]:
    """Names (and `self.x` attributes) a module binds to a pipeline: annotated as one, or
    assigned from a lookup, a `.pipeline` or another such name."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _is_pipeline_annotation(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and _is_pipeline_annotation(node.annotation):
            names.add(ast.unparse(node.target))
    for _ in range(3):  # assignments chain (`p = decode.pipeline; self._p = p`)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _reaches_pipeline(node.value, names):
                names.update(ast.unparse(t) for t in node.targets)
    return names


def _reaches_pipeline(node: ast.expr, names: set[str]) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "pipeline":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in PIPELINE_LOOKUPS
    return ast.unparse(node) in names


def _pipeline_state_reads(root: Path, surface: set[str]) -> list[str]:
    bad = []
    for path in sorted((root / "service").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = _pipeline_names(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _reaches_pipeline(node.value, names)
                and node.attr not in surface
            ):
                bad.append(f"{path.relative_to(root)}:{node.lineno} reads {ast.unparse(node)}")
    return bad


def test_no_service_module_reads_another_object_s_private_state() -> None:
    assert _foreign_private_reads(ROOT) == []


def test_the_service_reads_a_pipeline_only_through_its_query_surface() -> None:
    # The handoffs a pipeline holds are its own mutable records; the service reads immutable
    # views and counts through its `query` (`pipelines/decode/queries.py`, `pipelines/prefill/
    # queries.py`), so a listener or a route cannot change them or depend on their shape.
    assert _pipeline_state_reads(ROOT, _pipeline_surface()) == []


@pytest.mark.parametrize(
    ("source", "expect"),
    [
        (
            "def f(d: DecodePipeline):\n    return d._handoffs\n",
            "service/runtime/x.py:2 reads d._handoffs",
        ),
        (
            "def f(request):\n    return prefill_of(request).stages\n",
            "service/runtime/x.py:2 reads prefill_of(request).stages",
        ),
        (
            "def f(runtime):\n    p = runtime.pipeline\n    return p.leases.holds('a')\n",
            "service/runtime/x.py:3 reads p.leases",
        ),
        (
            "class J:\n    def __init__(self, d: DecodePipeline):\n        self._d = d\n"
            "    def on(self):\n        return self._d.cache\n",
            "service/runtime/x.py:5 reads self._d.cache",
        ),
    ],
)
def test_the_pipeline_state_checks_can_fail(source: str, expect: str, tmp_path: Path) -> None:
    (tmp_path / "service" / "runtime").mkdir(parents=True)
    (tmp_path / "service" / "runtime" / "x.py").write_text(source)
    found = _foreign_private_reads(tmp_path) + _pipeline_state_reads(tmp_path, _pipeline_surface())
    assert expect in found
    # ... and the surface itself passes: a query method is not a violation.
    (tmp_path / "service" / "runtime" / "x.py").write_text(
        "def f(request):\n    return prefill_of(request).query.decode_of('a')\n"
    )
    assert _pipeline_state_reads(tmp_path, _pipeline_surface()) == []
