"""The dependency rules of docs/architecture.md ("Module map"), checked on the source: who may
import (and reach into) whom.

``router -> {prefill_workers, decode_workers} -> {worker_protocol, kv_transfer} -> engine``;
the engine imports neither Ray nor gRPC; workers use the engine's seams (``kv_connector``, the
engine's public methods), never its scheduler, block manager or model runner; neither worker
kind imports the other. Inside the router, one direction (router/__init__.py):
``cli -> cluster -> control -> {routing, state} -> contract``, ``frontdoor -> contract``.
Across the project: no import cycles, and no module imports another's private names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
WORKER_PACKAGES = ("prefill_workers", "decode_workers")
ENGINE_INSIDES = ("engine.core.scheduler", "engine.core.block_manager", "engine.executor.model_runner")


def _modules(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    return files


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports, at top level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in _modules(package):
        for name in sorted(_imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("engine", ("ray", "grpc", "router", "kv_transfer", "worker_protocol", *WORKER_PACKAGES)),
    ("kv_transfer", ("ray", "router", "worker_protocol", *WORKER_PACKAGES)),
    ("worker_protocol", ("router", *WORKER_PACKAGES)),
    ("prefill_workers", ("router", "decode_workers", *ENGINE_INSIDES)),
    ("decode_workers", ("router", "prefill_workers", *ENGINE_INSIDES)),
    ("client", ("ray", "engine", "router", "kv_transfer", *WORKER_PACKAGES)),
])
def test_import_direction(package, forbidden):
    assert _violations(package, forbidden) == []


@pytest.mark.parametrize("package", WORKER_PACKAGES)
def test_workers_do_not_reach_into_the_engine(package):
    """``self.engine.scheduler.x`` needs no import, so the rule is checked on attributes too."""
    found = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("scheduler", "block_manager",
                                                                 "runner"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses .{node.attr}")
    assert found == []


# Each router package and the router modules it may import (besides its own package's).
ROUTER_RULES = {
    "router.contract": (),
    "router.frontdoor": ("router.contract",),
    "router.routing": (),
    "router.state": ("router.contract",),
    "router.control": ("router.contract", "router.routing", "router.state"),
    "router.embedded": ("router.contract", "router.state"),
    "router.cluster": ("router.contract", "router.control", "router.routing", "router.state"),
    "router.planning": ("router.contract", "router.cluster"),
    # Dashboards and alert rules (a developer's generator): metric names, no router code.
    "router.observability": (),
    "router.cli": ("router.contract", "router.embedded", "router.frontdoor", "router.cluster",
                   "router.control", "router.routing", "router.state", "router.planning"),
}
PRODUCT_PACKAGES = ("engine", "kv_transfer", "worker_protocol", "prefill_workers",
                    "decode_workers", "router", "client", "bench", "proto")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PRODUCT_PACKAGES for p in _modules(pkg)
            if "_pb2" not in p.name}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name lives in (``a.b.C`` -> ``a.b``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _owner(module: str) -> str:
    """The ROUTER_RULES key a router module falls under."""
    return next(k for k in ROUTER_RULES if module == k or module.startswith(k + "."))


def test_every_router_module_has_a_rule():
    modules = [m for m in _project_modules() if m.startswith("router.") and m != "router"]
    assert modules
    assert [m for m in modules if not any(m == k or m.startswith(k + ".")
                                          for k in ROUTER_RULES)] == []


def test_router_imports_go_one_way():
    """The front doors see only the contract; routing sees no other router package; nothing
    below the CLI imports the CLI, the cluster or the embedded engine; ..."""
    modules = _project_modules()
    found = []
    for name, path in modules.items():
        if not name.startswith("router.") or name == "router":
            continue
        own = _owner(name)
        allowed = (own, *ROUTER_RULES[own])
        for imported in sorted(_imports(path)):
            target = _resolve(imported, modules)
            if target is None or not target.startswith("router"):
                continue
            if target == "router" or not any(target == a or target.startswith(a + ".")
                                             for a in allowed):
                found.append(f"{path.relative_to(ROOT)} imports {target}")
    assert sorted(set(found)) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports. ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg`` (the way the names are looked up)."""
    modules = _project_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_resolve(a.name, modules) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(_resolve(f"{node.module}.{a.name}", modules)
                               for a in node.names)
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_no_import_cycles():
    """A cycle is a factory inside the contract it implements, or a module reaching into
    another's state: the factory goes beside its contract, the reach becomes a small protocol.
    Imports inside functions count too: deferring an import hides a cycle, it does not end it."""
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_names():
    modules = _project_modules()
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and _resolve(node.module, modules) not in (None, name):
                found += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}"
                          for a in node.names if a.name.startswith("_")
                          and not a.name.startswith("__")]
    assert found == []


def test_the_checker_sees_a_violation(tmp_path):
    """The rule checks above would pass vacuously if the scan found nothing."""
    mod = tmp_path / "bad.py"
    mod.write_text("def f():\n    from engine.core.scheduler import Scheduler\n    import ray.util\n")
    assert {"engine.core.scheduler", "engine.core.scheduler.Scheduler", "ray.util"} <= _imports(mod)


def test_pure_core_loads_without_torch():
    """The scheduler and block manager are plain Python (docs/architecture.md): importing
    them, and the config they share, must not pull torch in."""
    code = ("import sys, engine.core.scheduler, engine.core.block_manager, engine.config; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_front_door_loads_without_torch():
    """A router's front doors (the backend contract, HTTP and gRPC servers, their lifecycle)
    and the engine arguments they pass on are plain Python: a door process pays neither
    torch's import time nor its memory. (The cluster side of the router reads model configs
    through engine.weights.loader, which does load torch: docs/architecture.md.)"""
    code = ("import sys, router.contract, router.frontdoor.http_app, router.frontdoor.grpc_server, "
            "router.frontdoor.lifecycle, engine.args, kv_transfer, worker_protocol; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
