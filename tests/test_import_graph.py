"""The import graph of the project's own modules, read from the source (nothing is imported):
no import circle, and the top-level rooms only import downwards.

Imports under `if TYPE_CHECKING:` are annotations and do not count. An import inside a function
counts: it runs later, but the two modules still depend on each other.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the rooms the wheel installs under the one import name `pdserve` (setup.py); bench/ runs from
# the checkout under its own name
INSTALLED = ("kernels", "engine", "services", "autoscale", "sim", "profiler", "cli")
ROOMS = ("kernels", "engine", "services", "autoscale", "sim", "profiler", "cli", "bench")
# a room may import the rooms listed for it (and itself); everything else is an arrow up
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "services": {"engine", "kernels"},
    "autoscale": set(),
    "sim": {"services", "autoscale", "engine"},
    "profiler": {"engine", "services", "kernels", "sim"},
    "cli": {"engine", "services", "kernels", "autoscale", "sim", "profiler"},
    "bench": {"engine", "services", "kernels", "autoscale", "sim", "profiler", "cli"},
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted (the longest prefix that is a project module)
    at_module_level: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("pdserve", *parts) if parts[0] in INSTALLED else parts)


def room_of(module: str) -> str:
    """`pdserve.engine.llm` -> `engine`; `bench.report` -> `bench`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" else parts[0]


def project_modules() -> dict[str, Path]:
    modules = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            if "pb" in path.relative_to(ROOT).parts[:2] and path.parent.name == "pb":
                continue  # generated stubs
            modules[module_name(path)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from . import x / from .a import b
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    return [stem] + [f"{stem}.{alias.name}" for alias in node.names]


def _walk(node: ast.AST, in_function: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for sub in child.orelse:
                yield from _walk_one(sub, in_function)
            continue
        yield from _walk_one(child, in_function)


def _walk_one(node: ast.AST, in_function: bool):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, in_function
        return
    nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    yield from _walk(node, nested)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node, in_function in _walk(ast.parse(path.read_text(), str(path)), False):
        for dotted in _imported_names(node, package):
            target = _longest_module(dotted, modules)
            if target and target != name:
                found.append(Import(name, target, not in_function))
    return found


def _longest_module(dotted: str, modules: dict[str, Path]) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def all_imports() -> list[Import]:
    modules = project_modules()
    return [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_circles_finds_a_circle_and_not_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_reader_sees_relative_type_checking_and_function_imports(tmp_path):
    modules = {"engine": ROOT / "engine/__init__.py", "engine.a": tmp_path / "a.py", "engine.b": tmp_path / "b.py",
               "engine.c": tmp_path / "c.py"}
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nfrom .b import x\n"
                                   "if TYPE_CHECKING:\n    from engine.c import y\n"
                                   "def f():\n    import engine.c\n")
    found = imports_of("engine.a", tmp_path / "a.py", modules)
    assert Import("engine.a", "engine.b", True) in found
    assert Import("engine.a", "engine.c", False) in found
    assert Import("engine.a", "engine.c", True) not in found


def test_no_import_circle():
    edges: dict[str, set[str]] = {}
    for imp in all_imports():
        edges.setdefault(imp.source, set()).add(imp.target)
    # a package's __init__ importing its own submodules is how a package re-exports, not a circle
    for source, targets in edges.items():
        targets.difference_update({t for t in targets if source != t and t.startswith(source + ".")
                                   and (ROOT / source.replace(".", "/") / "__init__.py").exists()})
    assert circles(edges) == []


def test_rooms_import_only_downwards():
    upward = sorted({f"{imp.source} -> {imp.target}" for imp in all_imports()
                     if (src := room_of(imp.source)) != (dst := room_of(imp.target))
                     and dst not in ALLOWED[src]})
    assert upward == []


def _reached_by_sim(room: str) -> list[str]:
    return sorted({imp.target for imp in all_imports()
                   if room_of(imp.source) == "sim" and room_of(imp.target) == room})


def test_the_simulator_takes_only_the_routers_decisions_and_two_pure_engine_modules():
    services = _reached_by_sim("services")
    assert services and all(t.startswith("pdserve.services.router.decide") for t in services), services
    # the engine's defaults and its step-cost estimate, both pure: the simulator models the same
    assert _reached_by_sim("engine") == ["pdserve.engine.config", "pdserve.engine.step_rates"]


def test_every_import_of_an_installed_room_goes_through_pdserve():
    # `import engine` from the checkout's root would load a second copy of the module beside
    # pdserve.engine (and, installed, find no module or another distribution's `kernels`)
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "dist"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [])
            bare += [f"{rel}: {n}" for n in names if n.split(".")[0] in INSTALLED]
    assert bare == []


KVSTORE = "pdserve.services.kvstore"
# the kvstore's server side: the service itself, every transport's listener, every backend
KVSTORE_SERVER_SIDE = {f"{KVSTORE}.{m}" for m in ("server", "grpc_servicer", "handlers", "main",
                                                  "transports.tcp.server", "transports.ucx.server")}
WORKER_SIDE = tuple(f"pdserve.services.{room}" for room in ("worker", "prefill", "decode", "both"))


def _kvstore_server_side(module: str) -> bool:
    # stores.base is the contract and the keys, which validation on either side reads
    return module in KVSTORE_SERVER_SIDE or (module.startswith(f"{KVSTORE}.stores.")
                                             and module != f"{KVSTORE}.stores.base")


def _worker_side(module: str) -> bool:
    return (module.startswith(WORKER_SIDE) or module == f"{KVSTORE}.client"
            or (module.startswith(f"{KVSTORE}.transports.") and not _kvstore_server_side(module)))


def test_the_kvstores_stores_import_no_transport_server_and_no_server_side():
    modules = project_modules()
    stores = [m for m in modules if m.startswith(f"{KVSTORE}.stores.")]
    transports = [m for m in modules if m.startswith(f"{KVSTORE}.transports.")]
    assert f"{KVSTORE}.stores.memory" in stores and f"{KVSTORE}.transports.tcp.server" in transports
    wrong = sorted(f"{imp.source} -> {imp.target}" for imp in all_imports()
                   if imp.source in stores and imp.target in KVSTORE_SERVER_SIDE)
    assert wrong == []


def test_the_worker_side_never_imports_the_kvstores_server_side():
    modules = project_modules()
    assert _worker_side(f"{KVSTORE}.transports.tcp.client") and not _worker_side(f"{KVSTORE}.transports.tcp.server")
    assert sum(map(_worker_side, modules)) > 20
    wrong = sorted(f"{imp.source} -> {imp.target}" for imp in all_imports()
                   if _worker_side(imp.source) and _kvstore_server_side(imp.target))
    assert wrong == []
