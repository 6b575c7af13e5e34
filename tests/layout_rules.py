"""The package layout rules, read from the source with ``ast`` (nothing is imported): used by ``test_layout.py`` and
``benchmarks/layout_report.py``.

Every module of ``dla_recipes/`` (``testing/`` included) is parsed, and four rules are checked:

1. **No import cycle** between package modules. Every import counts, wherever it is (module level, inside a
   function, under ``if TYPE_CHECKING:``). Relative imports are resolved against the importing module's package.
   ``import P`` / ``import P.m`` is an edge to the named module (a package's ``__init__`` for ``P``);
   ``from P import name`` is an edge to ``P.name`` when that is a submodule, and to ``P`` (its ``__init__``) when
   ``name`` is something ``P`` itself defines or re-exports. So ``import dla_recipes`` and
   ``from dla_recipes import attribute`` inside the package are imports of ``dla_recipes/__init__.py``, while
   ``from . import sources`` is an import of ``sources`` only (the package is necessarily being imported already:
   taking a submodule from it does not run or read its ``__init__``).
2. **No private name across modules**: ``from X import _name`` with ``X`` a package module (a submodule named with
   a leading underscore, such as ``from . import _compat``, may be imported as a module), and ``m._name`` where
   ``m`` is a name bound to an imported package module (``models._ALIASES``, ``dla_recipes.models._ALIASES``).
   Dunder names (``__version__``) are not private.
3. **No module over** ``MAX_LINES`` lines.
4. **Every module starts with a docstring.**
5. **No function over** ``MAX_PARAMS`` **parameters, no call with more than** ``MAX_PARAMS`` **positional
   arguments** (``self`` / ``cls`` not counted; keyword-only parameters, ``*args`` and ``**kwargs`` counted; a
   starred argument ``f(*xs)`` counts as one). What travels together goes in a small frozen record, a long call
   names its arguments; only the public verbs of ``PUBLIC_VERBS`` are exempt.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "dla_recipes"
MAX_LINES = 400


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``line`` (``where``: ``"module level"``, ``"in f"``, ...)."""

    source: str
    target: str
    file: str  # the source's file, relative to the repository root
    line: int
    where: str
    statement: str

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.file}:{self.line}, {self.where}: {self.statement})"


@dataclass
class Module:
    """One parsed module of the package."""

    name: str  # dotted: "dla_recipes", "dla_recipes.api", "dla_recipes.testing.tiny"
    file: str  # relative to the repository root: "dla_recipes/api.py"
    is_package: bool  # an __init__.py
    tree: ast.Module
    lines: int
    edges: list[Edge] = field(default_factory=list)


def discover(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Module]:
    """Every ``.py`` file under ``root / package``, parsed: ``{dotted name: Module}``."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        text = path.read_text(encoding="utf-8")
        name = ".".join(parts)
        file = path.relative_to(root).as_posix()
        modules[name] = Module(name, file, is_package, ast.parse(text, filename=file), len(text.splitlines()))
    for module in modules.values():
        module.edges = imports_of(module, modules)
    return modules


def _scopes(tree: ast.Module) -> dict[ast.AST, str]:
    """``{import node: where}``: the innermost function or class holding it, and whether under ``TYPE_CHECKING``."""
    where: dict[ast.AST, str] = {}

    def visit(node: ast.AST, scope: str, type_checking: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            where[node] = scope + (", under TYPE_CHECKING" if type_checking else "")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"in {node.name}" if scope == "module level" else f"{scope}.{node.name}"
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:  # only the body is under TYPE_CHECKING: the else branch runs
                visit(child, scope, True)
            for child in node.orelse:
                visit(child, scope, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, scope, type_checking)

    visit(tree, "module level", False)
    return where


def resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` statement reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    base = ".".join(parts)
    return f"{base}.{node.module}" if node.module else base


def imports_of(module: Module, modules: dict[str, Module]) -> list[Edge]:
    """Every edge from ``module`` to another package module, in source order."""
    edges = []
    where = _scopes(module.tree)
    for node in ast.walk(module.tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        statement = ast.unparse(node)
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name in modules]
        else:
            base = resolve_from(module, node)
            if base in modules:
                names = [alias.name for alias in node.names]
                submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in modules]
                if len(submodules) < len(names):  # something taken from the module itself (its __init__)
                    targets.append(base)
                targets += submodules
        for target in targets:
            if target != module.name:
                edges.append(Edge(module.name, target, module.file, node.lineno, where.get(node, "module level"),
                                  statement))
    return sorted(edges, key=lambda e: (e.line, e.target))


# -- rule 1: cycles ---------------------------------------------------------------------------------------------------


def strongly_connected(modules: dict[str, Module]) -> list[list[str]]:
    """Tarjan's strongly connected components of the import graph, each sorted, largest first."""
    graph = {name: sorted({e.target for e in m.edges}) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return sorted(components, key=lambda c: (-len(c), c))


def cycle_in(component: list[str], modules: dict[str, Module]) -> list[Edge]:
    """One chain of edges inside ``component`` from its first module back to it (a shortest one)."""
    members = set(component)
    start = component[0]
    previous: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for name in frontier:
            for edge in modules[name].edges:
                if edge.target not in members:
                    continue
                if edge.target == start:
                    chain = [edge]
                    while chain[0].source != start:
                        chain.insert(0, previous[chain[0].source])
                    return chain
                if edge.target not in previous:
                    previous[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    return []


def cycles(modules: dict[str, Module]) -> list[tuple[list[str], list[Edge]]]:
    """``[(modules of a cycle, one edge chain closing it)]`` for every strongly connected component of size > 1."""
    return [(c, cycle_in(c, modules)) for c in strongly_connected(modules) if len(c) > 1]


# -- rule 2: private names --------------------------------------------------------------------------------------------


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(modules: dict[str, Module]) -> list[str]:
    """Every ``from X import _name`` and ``m._name`` of another package module's private name."""
    found = []
    for module in modules.values():
        bound: dict[str, str] = {}  # local name -> package module it is bound to (anywhere in the file)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != PACKAGE:
                        continue
                    if alias.asname:
                        if alias.name in modules:
                            bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(module, node)
                if base not in modules:
                    continue
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    if submodule in modules:
                        bound[alias.asname or alias.name] = submodule
                    elif is_private(alias.name) and base != module.name:
                        found.append(f"{module.file}:{node.lineno}: `{ast.unparse(node)}` imports the "
                                     f"private name {alias.name} of {base}")
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            chain = []
            value = node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id in bound):
                continue
            target = bound[value.id]
            for part in chain:  # dla_recipes.models._ALIASES: follow submodules as far as they go
                if f"{target}.{part}" not in modules:
                    target = None
                    break
                target = f"{target}.{part}"
            if target is None or target == module.name or f"{target}.{node.attr}" in modules:
                continue
            found.append(f"{module.file}:{node.lineno}: `{ast.unparse(node)}` reads the private name "
                         f"{node.attr} of {target}")
    return sorted(set(found), key=_by_file_and_line)


def _by_file_and_line(text: str) -> tuple[str, int]:
    path, line, _ = text.split(":", 2)
    return path, int(line)


# -- rule 5: parameters and positional arguments ---------------------------------------------------------------------

MAX_PARAMS = 6
# The public verbs keep every option as an explicit keyword-only parameter by design: a user reads them in the
# signature and the docs, and ``question.ask`` resolves them into one ``Question`` at once. The in-trace recipe's
# parameters past the sixth are keyword-only too. Exempt by qualified name ("module:function"), nothing else.
PUBLIC_VERBS = (
    "dla_recipes.api:attribute",
    "dla_recipes.direction:attribute_direction",
    "dla_recipes.generation:attribute_generation",
    "dla_recipes.scores:attribute_scores",
    "dla_recipes.datasets:attribute_dataset",
    "dla_recipes.in_trace:trace_attribution",
    "dla_recipes.trace.recipe:direct_logit_attribution",
)


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters: positional-only, positional, keyword-only, ``*args`` and ``**kwargs``; a first
    parameter named ``self`` or ``cls`` not counted."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + bool(a.vararg) + bool(a.kwarg)


def long_signatures(modules: dict[str, Module], limit: int = MAX_PARAMS,
                    exempt: tuple[str, ...] = PUBLIC_VERBS) -> list[str]:
    """Every function (method, nested function) of more than ``limit`` parameters, but the ``exempt`` ones."""
    found = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            count = parameter_count(node)
            if count > limit and f"{module.name}:{node.name}" not in exempt:
                found.append(f"{module.file}:{node.lineno}: {node.name} has {count} parameters (limit {limit})")
    return sorted(found, key=_by_file_and_line)


def long_calls(modules: dict[str, Module], limit: int = MAX_PARAMS) -> list[str]:
    """Every call with more than ``limit`` positional arguments (name them, or pass a record)."""
    found = []
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and len(node.args) > limit:
                found.append(f"{module.file}:{node.lineno}: a call of {ast.unparse(node.func)} with {len(node.args)} "
                             f"positional arguments (limit {limit})")
    return sorted(found, key=_by_file_and_line)


# -- rules 3 and 4 ----------------------------------------------------------------------------------------------------


# The stages, in the order of the work, and what each may import (besides itself). A module's stage is the first
# component of its name below the package (``dla_recipes.trace.kinds.linear`` -> ``trace``); ``face`` is the
# package's own ``__init__``, ``api``, ``in_trace`` and the CLI. Imports run one way: down this table.
GROUND = ("_compat", "errors", "components")
STAGES: dict[str, tuple[str, ...]] = {
    "_compat": (),
    "errors": (),
    "components": (),
    "args": GROUND,
    "families": GROUND,
    "math": (),
    "present": GROUND + ("math",),
    "selfcheck": GROUND + ("math",),
    "loading": GROUND + ("args", "families"),
    "plan": GROUND + ("args", "families"),
    "features": GROUND + ("plan",),  # dictionaries attached to a plan (dla_recipes.features)
    "trace": GROUND + ("args", "families", "plan", "math"),
    "transport": GROUND + ("args", "families", "plan", "trace"),
    "result": GROUND + ("present", "selfcheck", "trace"),
    "face": GROUND + ("args", "families", "loading", "plan", "features", "math", "trace", "transport", "selfcheck", "present",
                      "result", "face"),
    "testing": GROUND + ("face", "features", "loading"),  # features, loading: the docs' SAE (testing.dictionaries)
}
FACE = ("api", "direction", "question", "in_trace", "datasets", "generation", "scores", "__main__")


def stage_of(name: str, package: str = PACKAGE) -> str:
    """The stage of a module (``STAGES``' keys): its first name component below the package."""
    if name == package:
        return "face"
    first = name.split(".")[1]
    return "face" if first in FACE else first


def stage_violations(modules: dict[str, Module]) -> list[str]:
    """Every import from a stage to one it may not import (``STAGES``), and every module of no known stage."""
    found = []
    for module in modules.values():
        stage = stage_of(module.name)
        if stage not in STAGES:
            found.append(f"{module.file}: stage {stage!r} is not in layout_rules.STAGES (add it, with what it may import)")
            continue
        for edge in module.edges:
            target = stage_of(edge.target)
            if target != stage and target not in STAGES[stage]:
                found.append(f"{stage} -> {target}: {edge}")
    return found


def long_modules(modules: dict[str, Module], limit: int = MAX_LINES) -> list[str]:
    """Modules over ``limit`` lines, longest first."""
    over = sorted((m for m in modules.values() if m.lines > limit), key=lambda m: -m.lines)
    return [f"{m.file}: {m.lines} lines (limit {limit})" for m in over]


def missing_docstrings(modules: dict[str, Module]) -> list[str]:
    """Modules whose first statement is not a (non-empty) docstring."""
    return [f"{m.file}: no module docstring" for m in modules.values()
            if not (ast.get_docstring(m.tree) or "").strip()]


def edges_within(component: list[str], modules: dict[str, Module]) -> list[Edge]:
    """Every import between two modules of ``component`` (the candidates to cut)."""
    members = set(component)
    return [e for name in component for e in modules[name].edges if e.target in members]


def describe_cycles(found: list[tuple[list[str], list[Edge]]], modules: dict[str, Module] | None = None) -> list[str]:
    """Each cycle as text: its modules, the edge chain closing it, one edge a line, and (given ``modules``) every
    import inside the cycle."""
    lines = []
    for component, chain in found:
        lines.append(f"{len(component)} modules: {', '.join(component)}")
        lines.append("  one chain closing it:")
        lines += [f"    {edge}" for edge in chain]
        if modules is not None:
            within = edges_within(component, modules)
            lines.append(f"  every import inside it ({len(within)}):")
            lines += [f"    {edge}" for edge in within]
    return lines
