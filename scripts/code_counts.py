"""The counts docs/architecture.md states about the code, each read from the source (ast and text, no imports).

    python scripts/code_counts.py          # prints each count; exit 0

- modules over 600 lines;
- command functions (``@app.command`` / ``@*_app.command``) and their body lengths (lines after the signature);
- call sites, outside the module that defines them, of the sharpness measurement (``measure_sharpness``), of the
  report writer (``write_report``) and of run creation (``create_run``);
- ``hasattr``/``getattr`` lines in cemtool/analysis (capability probes and otherwise).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cemtool"


def modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def command_bodies(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
                for d in node.decorator_list):
            first = node.body[0]
            start = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                else first.lineno - 1  # the docstring is not code
            out.append((node.name, node.end_lineno - start))
    return out


def call_sites(name: str) -> list[str]:
    found = []
    for p in modules():
        tree = ast.parse(p.read_text(encoding="utf-8"))
        defines = any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name \
                    and not defines:
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return found


def main() -> int:
    long = [(p, n) for p in modules() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600]
    print(f"modules over 600 lines: {len(long)}" + "".join(f"\n  {p.relative_to(ROOT)} ({n})" for p, n in long))
    cmds = [(p, f, n) for p in sorted((PKG / "cli").glob("*_cmd.py")) for f, n in command_bodies(p)]
    over = [(p, f, n) for p, f, n in cmds if n > 60]
    print(f"command functions: {len(cmds)}, longest body {max(n for *_, n in cmds)} lines, over 60: {len(over)}"
          + "".join(f"\n  {p.relative_to(ROOT)}:{f} ({n})" for p, f, n in over))
    for name in ("measure_sharpness", "write_report", "create_run"):
        sites = call_sites(name)
        print(f"calls of {name} outside its module: {len(sites)}" + "".join(f"\n  {s}" for s in sites))
    probes = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((PKG / "analysis").rglob("*.py"))
              for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
              if "hasattr(" in line or "getattr(" in line]
    print(f"hasattr/getattr lines in cemtool/analysis: {len(probes)}" + "".join(f"\n  {s}" for s in probes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
