"""The import graph of the cemtool package: its cycles and its imports inside functions.

    python scripts/import_graph.py [--report] [--root PATH] [--only FILE ...]

Reads every module under the package (cemtool/ beside this script, or --root) with `ast`, without importing it, and
counts every import statement: at module level and inside functions, `import x` and `from x import y`, relative
ones too. `from cemtool.pkg import name` is an edge to cemtool.pkg.name when that is a module, else to cemtool.pkg.
Importing cemtool.pkg.mod also runs cemtool/pkg/__init__.py, so it is an edge to cemtool.pkg as well, unless the
importer is itself inside cemtool.pkg (which is then already loaded). Imports under `if TYPE_CHECKING:` never run:
they are counted but make no edge. Imports by name at run time (importlib.import_module) are not seen. Prints

- the import cycles: strongly connected components of more than one module, each with the imports that close it;
- every import inside a function or method, file:line, and whether a comment on its line or the line above justifies
  it: the word "optional" (an optional dependency) or "start-up"/"startup" (a measured start-up cost);
- the totals.

Exits 1 when there is a cycle or an unjustified import inside a function, 0 otherwise; with --report it only prints
and exits 0. With --only, the imports inside functions are those of the given files alone (the cycles are still the
whole package's).
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

JUSTIFIED = re.compile(r"optional|start-?up", re.IGNORECASE)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    path: str  # its file, relative to the package's parent
    line: int
    text: str  # the statement's first line
    in_function: bool
    type_only: bool  # under `if TYPE_CHECKING:`
    justified: bool  # a justification comment on its line or the line above
    targets: tuple[str, ...]  # package modules it imports (empty for anything outside the package)


@dataclass
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    imports: list[Import] = field(default_factory=list)

    def reached(self, imp: Import) -> set[str]:
        """The modules an import runs: its targets and the packages above them that are not above the importer
        (importing pkg.sub.mod runs pkg/sub/__init__.py first; the importer's own packages are already loaded)."""
        if imp.type_only:
            return set()
        own = set(_packages(imp.module))
        out = {p for t in imp.targets for p in _packages(t) if p in self.modules and p not in own}
        return (out | set(imp.targets)) - {imp.module}

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {m: set() for m in self.modules}
        for imp in self.imports:
            out[imp.module].update(self.reached(imp))
        return out


def _packages(module: str) -> list[str]:
    """The packages above a dotted module name: pkg.sub.mod -> [pkg, pkg.sub]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file for every .py file of the package at ``root`` (its __init__.py is the package)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def comment_lines(source: str) -> dict[int, str]:
    """Line number -> the comment on that line."""
    comments = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass
    return comments


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that importing ``name`` reaches: ``name`` itself, or its longest module prefix."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of a `from ... import` (relative ones resolved against the importing module)."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        found = [_resolve(a.name, modules) for a in node.names]
    else:
        base = _from_base(node, module, is_package)
        found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _resolve(base, modules) for a in node.names]
    return sorted({t for t in found if t})


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False, type_only: bool = False):
    """Every import statement below ``node``, with whether it sits in a function and under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, type_only
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True, type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, type_only)
        else:
            yield from _walk(child, in_function, type_only)


def build_graph(root: Path) -> Graph:
    """Every import of the package at ``root`` (a directory with __init__.py)."""
    root = root.resolve()
    modules = module_names(root)
    graph = Graph(modules)
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        comments = comment_lines(source)
        is_package = path.name == "__init__.py"
        for node, in_function, type_only in _walk(ast.parse(source, filename=str(path))):
            nearby = [comments.get(n, "") for n in range(node.lineno - 1, (node.end_lineno or node.lineno) + 1)]
            graph.imports.append(Import(
                module=module, path=str(path.relative_to(root.parent)), line=node.lineno,
                text=lines[node.lineno - 1].strip(), in_function=in_function, type_only=type_only,
                justified=any(JUSTIFIED.search(c) for c in nearby),
                targets=tuple(_targets(node, module, is_package, modules))))
    graph.imports.sort(key=lambda i: (i.path, i.line))
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
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
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def report(graph: Graph, only: set[str] | None = None) -> tuple[list[list[str]], list[Import], list[str]]:
    """(cycles, unjustified imports inside functions, printed lines); ``only``: the files (paths relative to the
    package's parent, as :attr:`Import.path`) whose imports inside functions are listed and counted."""
    found = cycles(graph.edges())
    in_functions = [i for i in graph.imports if i.in_function and (only is None or i.path in only)]
    out = [f"import cycles: {len(found)}"]
    for component in found:
        members = set(component)
        out.append("  " + " <-> ".join(component))
        for imp in graph.imports:
            if imp.module in members and members & graph.reached(imp):
                where = "in a function" if imp.in_function else "module level"
                out.append(f"    {imp.path}:{imp.line} ({where}): {imp.text}")
    unjustified = [i for i in in_functions if not i.justified]
    scope = "" if only is None else f" of {len(only)} file(s)"
    out.append(f"imports inside functions{scope}: {len(in_functions)} ({len(unjustified)} without a justification)")
    for imp in in_functions:
        mark = "ok  " if imp.justified else "NO  "
        out.append(f"  {mark}{imp.path}:{imp.line}: {imp.text}")
    module_level = sum(not i.in_function for i in graph.imports)
    type_only = sum(i.type_only for i in graph.imports)
    out.append(f"totals: {len(graph.modules)} modules, {len(graph.imports)} import statements "
               f"({module_level} at module level, {len(in_functions)} inside functions{scope}, {type_only} "
               f"type-checking only); {len(found)} import cycles; {len(unjustified)} unjustified imports inside "
               f"functions{scope}")
    return found, unjustified, out


def package_paths(root: Path, files: list[Path]) -> set[str]:
    """The given files as :attr:`Import.path` names them (relative to the package's parent); a file outside the
    package, or missing, is refused."""
    base = root.resolve().parent
    out = set()
    for f in files:
        path = f.resolve()
        if not path.is_file() or not path.is_relative_to(root.resolve()):
            raise SystemExit(f"--only: {f} is not a file of the package at {root}")
        out.add(str(path.relative_to(base)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="only print; exit 0 whatever is found")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1] / "cemtool",
                        help="the package directory (default: cemtool/ of this checkout)")
    parser.add_argument("--only", type=Path, nargs="+", metavar="FILE",
                        help="list and count the imports inside functions of these files only")
    args = parser.parse_args(argv)
    only = package_paths(args.root, args.only) if args.only else None
    found, unjustified, lines = report(build_graph(args.root), only)
    print("\n".join(lines))
    return 0 if args.report or not (found or unjustified) else 1


if __name__ == "__main__":
    sys.exit(main())
