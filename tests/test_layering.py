"""The package's import structure, read from the source: no import cycle between modules, and
each layer imports only the layers below it (codecs → collectives → pricing → algorithms → front ends).

Imports under ``if TYPE_CHECKING`` never run and do not count. Imports inside functions run
later and cannot break an import, but they are arrows all the same: the cycle check counts
them, except the few upward ones in :data:`LAZY_UPWARD`, each with its reason. ``from package
import name`` counts as an import of the submodule when ``name`` is one.
"""
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lowbit_strategy", "callbacks")

#: imports inside functions that point up the layers, allowed by name (module, imported module)
LAZY_UPWARD = {
    # LionCommunicator() with no config builds the default LowBitConfig; the config reads the
    # registry, which imports this module
    ("lowbit_strategy.algorithms.lion_cub.communicator", "lowbit_strategy.config"),
    # the package root lists its Lightning names from the registry and loads the Lightning
    # front end on first use, without importing Lightning at `import lowbit_strategy`
    ("lowbit_strategy", "lowbit_strategy.algorithms"),
    ("lowbit_strategy", "lowbit_strategy.integrations.lightning"),
    ("lowbit_strategy", "lowbit_strategy.integrations.lightning_sharded"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # the tree does not change during a run: parse it once
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(tree: ast.AST, lazy: bool = True):
    """``(import node, inside a function)`` for every import that can run (not under
    ``if TYPE_CHECKING``); only those that run at import time unless ``lazy``."""
    todo = [(n, False) for n in ast.iter_child_nodes(tree)]
    while todo:
        node, in_function = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo += [(n, in_function) for n in node.orelse]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if lazy:
                todo += [(n, True) for n in ast.iter_child_nodes(node)]
        else:
            todo += [(n, in_function) for n in ast.iter_child_nodes(node)]


def _top_level_imports(tree: ast.AST):
    return (node for node, _ in _imports(tree, lazy=False))


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = graph.setdefault(name, set())
        for node, in_function in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = name.split(".") if is_package else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges.update(t for t in targets if t in modules and t != name
                         and not (in_function and (name, t) in LAZY_UPWARD))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: e for m, e in _graph().items() if m == prefix or m.startswith(prefix + ".")}


def _external(prefix: str) -> dict[str, set[str]]:
    """Every module-level import (dotted names, external packages included) of the modules under ``prefix``."""
    out: dict[str, set[str]] = {}
    for name, path in _modules().items():
        if name == prefix or name.startswith(prefix + "."):
            out[name] = {a.name if isinstance(n, ast.Import) else (n.module or "")
                         for n in _top_level_imports(ast.parse(path.read_text())) for a in n.names}
    return out


def test_layers_import_downwards():
    above = {
        "lowbit_strategy.codecs": ("lowbit_strategy.collectives", "lowbit_strategy.algorithms",
                                   "lowbit_strategy.integrations", "lowbit_strategy.config", "lowbit_strategy.nn"),
        "lowbit_strategy.collectives": ("lowbit_strategy.pricing", "lowbit_strategy.algorithms",
                                        "lowbit_strategy.integrations", "lowbit_strategy.config",
                                        "lowbit_strategy.nn", "lowbit_strategy.plan"),
        # pricing reads the collectives' layouts (what they send); the auto plans read pricing
        "lowbit_strategy.pricing": ("lowbit_strategy.algorithms", "lowbit_strategy.integrations",
                                    "lowbit_strategy.config", "lowbit_strategy.nn", "lowbit_strategy.plan"),
        "lowbit_strategy.algorithms": ("lowbit_strategy.integrations", "lowbit_strategy.config", "callbacks"),
        "lowbit_strategy.nn": ("lowbit_strategy.collectives", "lowbit_strategy.algorithms",
                               "lowbit_strategy.integrations"),
    }
    for layer, forbidden in above.items():
        for module, edges in _imports_of(layer).items():
            bad = sorted(e for e in edges if e.startswith(forbidden))
            assert not bad, f"{module} imports {bad}, a layer above it"
    # nothing in the library imports the callbacks package (callbacks depend on the library)
    for module, edges in _imports_of("lowbit_strategy").items():
        assert not any(e.startswith("callbacks") for e in edges), module


def test_codecs_are_pure_and_only_front_ends_import_frameworks():
    for module, names in _external("lowbit_strategy.codecs").items():
        assert not any(n.startswith("torch.distributed") for n in names), f"{module} talks to torch.distributed"
    frameworks = ("lightning", "pytorch_lightning", "accelerate", "transformers")
    allowed = {"lowbit_strategy.integrations.lightning", "lowbit_strategy.integrations.lightning_sharded",
               "lowbit_strategy.integrations.accelerate",
               "lowbit_strategy.integrations.hf"}
    for module, names in _external("lowbit_strategy").items():
        if module not in allowed:
            bad = sorted(n for n in names if n.split(".")[0] in frameworks)
            assert not bad, f"{module} imports {bad} at module level"


def _private_names_used_elsewhere() -> list[str]:
    """``module: name from owner`` for every ``_name`` (not dunder) one library module imports
    from another, or reads as ``owner_alias._name``."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGES):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        aliases[a.asname or a.name] = full
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{name}: {a.name} from {node.module}")
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}: {node.attr} from {aliases[node.value.id]}")
    return sorted(set(found))


def test_no_private_name_is_shared_between_modules():
    """A name another module needs is public in the module that owns it (one home, one name).
    (A private *module*, ``_moved`` or ``integrations/_factories``, is the package's own.)"""
    shared = _private_names_used_elsewhere()
    assert not shared, "private names used outside their module: " + "; ".join(shared)
