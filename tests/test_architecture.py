"""The one-way architecture, checked on the source: no import cycle among fold's modules
(imports inside functions included), and handle bits read only through ``fold._encoding``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fold

PACKAGE = Path(fold.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The fold modules ``name`` imports anywhere in its source (top level, functions,
    ``importlib.import_module`` with a literal or an f-string over fold's submodules),
    except under ``if TYPE_CHECKING:``.

    An import names the module it reads: ``from fold.scheduler.plan import Plan`` is an edge
    to ``fold.scheduler.plan``, ``from fold import inspect`` one to ``fold.inspect``,
    ``from fold.scheduler import Plan`` one to the package ``fold.scheduler``.  (Python
    also runs the parent packages' ``__init__`` first; those are each package's top and
    import downward, so they are left out rather than making every module a cycle.)
    """
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for b in node.body for n in ast.walk(b))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant):
                found.add(arg.value)
            elif isinstance(arg, ast.JoinedStr):  # f"fold.{name}": any direct submodule
                prefix = "".join(v.value for v in arg.values if isinstance(v, ast.Constant))
                found.update(m for m in modules if m.startswith(prefix) and m.count(".") == 1)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None.  Iterative DFS."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle_among_folds_modules_lazy_imports_included() -> None:
    graph = _graph()
    assert len(graph) > 20 and graph["fold.graph"]  # the walk found the modules
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_stages_import_only_the_stages_below_them() -> None:
    """record (graph) -> arrays -> plan (scheduler) -> execute (executor): no stage below
    imports one above it."""
    graph = _graph()
    order = ["fold._encoding", "fold.arrays", "fold.scheduler", "fold.ops", "fold.values"]
    order += ["fold.executor", "fold.run", "fold.graph"]
    below = {m: set(order[:i]) for i, m in enumerate(order)}

    def reach(m: str) -> set[str]:
        seen, todo = set(), [m]
        while todo:
            for n in graph[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    for m in order:
        above = {x for x in reach(m) if x in order} - below[m]
        assert not above, f"{m} imports {sorted(above)}, a later stage"
    assert reach("fold._encoding") == {"fold.errors"}  # a leaf but for the error class
    assert not reach("fold.errors")


# A shift or mask by the layout's numbers (16, 44, 7, 8, 127, 255, 65535) outside the one
# module that owns the layout.
_RAW_BITS = re.compile(r"(>>|<<)\s*(7|8|16|44)\b|&\s*(127|255|65535|0x7[fF]|0xff|0xFF)\b")


def test_handle_bits_are_read_through_the_encoding_module_only() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "fold._encoding":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _RAW_BITS.search(code):
                offenders.append(f"{name}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_autobatch_parts_import_only_the_parts_before_them() -> None:
    """fold/autobatch/ is one job per file, in a one-way order (the package docstring's):
    each part imports only the parts before it (a part above reaches a part below through
    ``common.HOOKS``), the package's ``__init__`` only re-exports, and nothing else in fold
    but ``fold/__init__`` imports autobatch."""
    graph = _graph()
    order = ["common", "values", "buffers", "running", "patches", "batchable", "ops", "tables"]
    order += ["recorder"]
    order = [f"fold.autobatch.{m}" for m in [*order, "traced", "driver"]]
    parts = {m for m in graph if m.startswith("fold.autobatch.")}
    assert parts == set(order), "a part of fold/autobatch/ is missing from the order"
    for i, m in enumerate(order):
        later = {x for x in graph[m] if x in order[i + 1 :] or x == "fold.autobatch"}
        assert not later, f"{m} imports {sorted(later)}, a later part"
    outside = {
        m
        for m, deps in graph.items()
        if not m.startswith("fold.autobatch")
        and m != "fold"
        and any(d.startswith("fold.autobatch") for d in deps)
    }
    assert not outside, f"{sorted(outside)} import autobatch"
    # autobatch records into a Fold and applies it: it sits above every stage.
    stages = {"fold.graph", "fold.run", "fold.executor", "fold.arrays", "fold.scheduler"}
    for m in order:
        assert not {d for d in graph[m] if d.startswith("fold.autobatch")} - set(order)
        assert graph[m] <= set(graph) and not (graph[m] & {"fold"}), m
    assert stages & set().union(*(graph[m] for m in order))
