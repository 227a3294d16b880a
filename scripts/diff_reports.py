"""Compare two trees of cemtool outputs (e.g. sample_runs/ written by two versions of cemtool) number by number.

    python scripts/diff_reports.py OLD NEW [--tol 0]

Every .json, .jsonl and .csv file under OLD must exist under NEW with the same numbers: JSON is parsed and
compared value by value (numbers exactly, or within --tol relative), CSV cell by cell; with --text also .md and
.txt line by line, their numbers compared the same way. What legitimately differs between two executions is left
out: wall-clock times (keys containing "seconds", "time", "started", "ended", "created", "date", "eta"), versions
and commits, the command line ("argv"), process ids, hostnames, thread counts and the load average, and the name of
the temporary folder the outputs were made in. Figures (.png, .svg) are not compared. Prints one line per
difference; exit 1 when there is any.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
from pathlib import Path

IGNORED = re.compile(r"seconds|time|started|ended|created|date|^eta$|versions|git_commit|^torch$|^python$|"
                     r"^cemtool$|platform|^argv$|^pid$|host|threads|sessions|^elapsed|per_second|throughput|"
                     r"tokens_per_s|^total$|^numpy$|^transformers$|^rss|^wall_s$|^cpu_s$|load_average", re.I)
TEMP = re.compile(r"cemtool-samples\.\w+|tmp\w{8}")  # the temporary folder a run was made in
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def same_number(a: float, b: float, tol: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    return a == b or (tol > 0 and abs(a - b) <= tol * max(abs(a), abs(b)))


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def diff_values(a, b, where: str, tol: float, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if IGNORED.search(str(k)):
                continue
            if k not in a or k not in b:
                out.append(f"{where}.{k}: only in {'new' if k not in a else 'old'}")
                continue
            diff_values(a[k], b[k], f"{where}.{k}", tol, out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items, now {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            diff_values(x, y, f"{where}[{i}]", tol, out)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not same_number(float(a), float(b), tol):
            out.append(f"{where}: {a!r} -> {b!r}")
    elif isinstance(a, str) and isinstance(b, str) and TEMP.sub("*", a) == TEMP.sub("*", b):
        return
    elif isinstance(a, str) and isinstance(b, str) and _number(a) is not None and _number(b) is not None:
        if not same_number(_number(a), _number(b), tol):  # a CSV cell
            out.append(f"{where}: {a} -> {b}")
    elif a != b:
        out.append(f"{where}: {str(a)[:80]!r} -> {str(b)[:80]!r}")


def parse(path: Path):
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    return text.splitlines()  # .md, .txt


def diff_lines(a: list[str], b: list[str], where: str, tol: float, out: list[str]) -> None:
    """Markdown/text: the same lines, with numbers compared as numbers (a line naming a time is skipped)."""
    keep = [(x, y) for x, y in zip(a, b, strict=False) if not IGNORED.search(x)]
    if len(a) != len(b):
        out.append(f"{where}: {len(a)} lines, now {len(b)}")
    for n, (x, y) in enumerate(keep):
        if NUMBER.sub("#", x) != NUMBER.sub("#", y):
            out.append(f"{where} line {n + 1}: {x[:60]!r} -> {y[:60]!r}")
            continue
        for u, v in zip(NUMBER.findall(x), NUMBER.findall(y), strict=False):
            if not same_number(float(u), float(v), tol):
                out.append(f"{where} line {n + 1}: {u} -> {v}")
                break


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--tol", type=float, default=0.0, help="relative tolerance of a number (default 0: exact)")
    ap.add_argument("--text", action="store_true", help="also compare .md and .txt files (printed tables)")
    args = ap.parse_args(argv)
    suffixes = {".json", ".jsonl", ".csv"} | ({".md", ".txt"} if args.text else set())
    out: list[str] = []
    files = sorted(p for p in args.old.rglob("*") if p.is_file() and p.suffix in suffixes)
    for p in files:
        rel = p.relative_to(args.old)
        q = args.new / rel
        if not q.is_file():
            out.append(f"{rel}: missing in {args.new}")
            continue
        a, b = parse(p), parse(q)
        if p.suffix in (".md", ".txt"):
            diff_lines(a, b, str(rel), args.tol, out)
        else:
            diff_values(a, b, str(rel), args.tol, out)
    for p in sorted(q for q in args.new.rglob("*") if q.is_file() and q.suffix in suffixes):
        if not (args.old / p.relative_to(args.new)).exists():
            out.append(f"{p.relative_to(args.new)}: only in {args.new}")
    for line in out:
        print(line)
    print(f"{len(files)} files compared, {len(out)} difference(s)", file=sys.stderr)
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main())
