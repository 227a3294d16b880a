"""Fuzz the cemtool CLI: random command lines built from the real app, each judged like scripts/bad_inputs.py.

The commands and their parameters come from the app itself (``typer.main.get_command(app)``, subcommand groups
included). Each case picks a command, gives a random subset of its options values of the right type and of wrong
ones (negative, zero, huge, nan, inf, empty, odd unicode, a path that does not exist, a file of garbage, a folder
that is not a run), arguments (a copy of a tiny trained run half the time) and now and then a stray extra argument.
To keep each case short, commands that train get tiny model settings (``--set``) most of the time, ``--quick`` is
passed where it exists most of the time, and token counts of the right type are small; `archs`, `demo` and
`saturation sweep` mostly get small settings (``SHORTEN``).

Every case runs in process (typer's CliRunner) in its own temporary workspace (the current directory during the
case) holding a copy of the tiny run (``run/``), a garbage file and a folder that is not a run, with a time limit
(``--limit``, default 20 s; a case that runs past it is stopped and counted as timed out, not judged). A case is
clean when it exits 0, or exits 1 with a first line ``Error: ...`` (and at most a hint line; ``note:`` lines may
come before it), or exits 2 with a usage message; never a traceback or "internal error"; and it writes nothing
outside its workspace (checked: the folder holding the workspaces, the paths outside given to it, and the
repository's ``git status``).

    python scripts/fuzz_cli.py                    # 200 command lines, seed 0
    python scripts/fuzz_cli.py --count 50 --seed 3

Prints the unclean cases (command line, exit code, output) and ``fuzzed N / clean M``; exits 0 only if no case
is unclean.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bad_inputs import TEXT, TINY, write  # noqa: E402

OUTSIDE = "/nonexistent-cemtool-fuzz"  # absolute paths given to commands; must still not exist afterwards
SMALL = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.seq_len=8", "train.max_steps=4",
         "train.eval_every=2", "train.eval_tokens=64", "data.tokenizer=byte", "train.batch_size=4"]
ODD = ["", " ", "-", "--", "名前", "\u202eevil", "e\u0301", "🙂", "a" * 300, "../../escape", "x=y", "=", ",", "%s",
       "$HOME", "\t", "nan", "inf", "-1", "0", "1e309", "NULL", "None", "true"]
GOOD_INTS = ["1", "2", "3", "4", "8", "16"]
BAD_INTS = ["0", "-1", "-7", "10" + "0" * 20, "2147483648", "nan", "inf", "1.5", "abc", "", "１２", "0x10", "1e3", " 4"]
GOOD_FLOATS = ["0.5", "1e-3", "0.1", "1", "2"]
BAD_FLOATS = ["0", "-1", "nan", "inf", "-inf", "1e308", "1e-320", "abc", "", "1,5"]
KNOWN = {  # values of the right kind for string options that name things
    "arch": ["baseline", "tmm", "lime", "cem", "nosuch"], "archs": ["baseline", "baseline,tmm", "baseline,baseline"],
    "data": ["grammar", "CORPUS", "pydoc", "ngram"], "device": ["cpu", "cuda", "mps", "auto", "tpu9"],
    "checkpoint": ["final", "10", "20", "step_000010", "0"], "seeds": ["0", "0,1", "1,1"],
    "set_": SMALL + TINY + ["train.lr=nan", "model.nosuch=1", "train.max_steps=-1"],
    "dtype": ["fp32", "fp64", "bf16"], "to": ["grammar-b", "hf", "CORPUS"],
    "analyses": ["sharpness", "collapse", "forgetting", "sharpness,collapse"],
    "option": ["sharpness.tokens=64", "collapse.per_class=4", "forgetting.steps=2"],
    "grid": ["train.lr=1e-3,3e-3", "model.d_model=16,32"], "prompt": ["The", "名前", ""],
}

SHORTEN = {  # commands whose defaults take minutes: small settings most of the time
    ("archs",): ["--arch", "baseline"], ("demo",): ["--archs", "baseline", "--seeds", "0"],
    ("saturation", "sweep"): ["--head-dims", "2,4", "--seq-lens", "8", "--seeds", "0", "--steps", "4",
                              "--train-tokens", "4000", "--eval-tokens", "256", "--no-plots"],
}


class CaseTimeout(BaseException):
    """Raised by the alarm in the command's frame: a BaseException, so no `except Exception` in cemtool eats it."""


def commands(group) -> list[tuple[list[str], object]]:
    """(names, click command) of every leaf command of the app."""
    out = []
    for name, cmd in group.commands.items():
        if getattr(cmd, "commands", None):  # a group (typer's own click: isinstance(click.Group) does not hold)
            out += [([name, *n], c) for n, c in commands(cmd)]
        else:
            out.append(([name], cmd))
    return out


def base_type(param) -> tuple[type, bool]:
    """The parameter's Python type without Optional/list, and whether it takes several values."""
    ann = param.type_descriptor.annotation
    many = False
    while typing.get_origin(ann) in (typing.Union, list) or str(typing.get_origin(ann)) == "<class 'types.UnionType'>":
        if typing.get_origin(ann) is list:
            many = True
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    return ann, many


def value(rng: random.Random, param, ws: Path) -> str:
    """One value for ``param``: of its type (or a name it knows) most of the time, anything some of the time."""
    t, _ = base_type(param)
    if rng.random() < 0.1:
        return rng.choice(ODD)
    if t is Path or param.name in ("run", "runs", "paths", "root", "resume", "tuned", "config", "file"):
        return path_value(rng, param, ws)
    if t is int:
        if param.name in ("tokens", "eval_tokens", "at_tokens") and rng.random() < 0.7:
            return str(rng.choice([16, 64, 128, 256]))
        return good_or_bad(rng, GOOD_INTS, BAD_INTS, param.default)
    if t is float:
        return good_or_bad(rng, GOOD_FLOATS, BAD_FLOATS, param.default)
    known = KNOWN.get(param.name)
    if known and rng.random() < 0.7:
        v = rng.choice(known)
        return str(ws / "corpus.txt") if v == "CORPUS" else v
    if param.default not in (None, "") and not isinstance(param.default, (list, tuple)) and rng.random() < 0.5:
        return str(param.default)
    return rng.choice(ODD)


def good_or_bad(rng: random.Random, good: list[str], bad: list[str], default) -> str:
    if rng.random() < 0.35:
        return rng.choice(bad)
    return str(default) if default is not None and rng.random() < 0.5 else rng.choice(good)


def path_value(rng: random.Random, param, ws: Path) -> str:
    if param.name in ("run", "runs", "paths", "resume", "root") and rng.random() < 0.5:
        return str(ws / "run")
    return rng.choice([str(ws / "run"), str(ws / "garbage.bin"), str(ws / "notarun"), str(ws / "nosuch" / "x"),
                       str(ws / "out"), f"{OUTSIDE}/x", "", str(ws / "corpus.txt"), str(ws / "run" / "meta.json"),
                       str(ws / "run" / "checkpoints" / "final.safetensors"), "runs/new"])


def command_line(rng: random.Random, app_cmd, ws: Path) -> list[str]:
    """A random command line for a random leaf command of the app."""
    names, cmd = rng.choice(commands(app_cmd))
    args = list(names)
    if rng.random() < 0.1:
        args = ["--threads", rng.choice(["1", "0", "-1", "x", "2"])] + args
    params = {p.name: p for p in cmd.params}
    opts = [p for p in cmd.params if getattr(p, "opts", None) and p.opts[0].startswith("-")]
    for p in rng.sample(opts, k=min(len(opts), rng.choice([0, 1, 1, 2, 2, 3, 4, 6]))):
        _, many = base_type(p)
        if p.is_flag:
            args.append(rng.choice(p.opts + list(p.secondary_opts)))
            continue
        for _ in range(rng.choice([1, 1, 2, 3]) if many else 1):
            args += [rng.choice(p.opts), value(rng, p, ws)]
    if "quick" in params and rng.random() < 0.8:
        args.append("--quick")
    if "set_" in params and names[0] in ("train", "sweep") and rng.random() < 0.8:
        args += [a for s in SMALL for a in ("--set", s)]
    if tuple(names) in SHORTEN and rng.random() < 0.8:
        args += SHORTEN[tuple(names)]
    if "jobs" in params and "--jobs" not in args and "-j" not in args and rng.random() < 0.5:
        args += ["--jobs", rng.choice(["1", "2"])]
    for p in cmd.params:
        if not getattr(p, "opts", None) or p.opts[0].startswith("-"):
            continue
        if p.required or rng.random() < 0.8:  # an argument: nargs -1 takes one or two
            args += [value(rng, p, ws) for _ in range(rng.choice([1, 1, 2]) if p.nargs == -1 else 1)]
    if rng.random() < 0.1:
        args.insert(rng.randrange(1, len(args) + 1), rng.choice(["--nosuch", "-x", "extra", "名前", "--", "-"]))
    return args


def verdict(code: int | None, output: str) -> str | None:
    """Why the answer is not clean, or None (the rules of scripts/bad_inputs.py's judge, except that `note:` lines
    may come first: `--threads N` above the free cores notes so before the command has even read its options)."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    while lines and lines[0].startswith("note: "):
        lines.pop(0)
    if "Traceback" in output or "internal error" in output:
        return "traceback or internal error"
    if code == 0:
        return None
    if code == 1:
        return None if lines and lines[0].startswith("Error: ") and len(lines) <= 2 else \
            "exit 1 without a one-line 'Error:'"
    if code == 2:
        return None if "Usage:" in output else "exit 2 without a usage message"
    return f"exit {code}"


def workspace(ws: Path, base_run: Path) -> None:
    shutil.copytree(base_run, ws / "run", ignore=shutil.ignore_patterns(".lock"))
    write(ws / "garbage.bin", random.Random(1).randbytes(4096))
    write(ws / "notarun" / "readme.txt", "not a run")
    write(ws / "corpus.txt", TEXT)


def run_case(runner, app, args: list[str], limit: float) -> tuple[int | None, str]:
    """Run one command line in process with an alarm after ``limit`` seconds: (exit code or None, output)."""
    def alarm(signum, frame):
        raise CaseTimeout()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        res = runner.invoke(app, args)
    except CaseTimeout:
        return None, ""
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    output = res.output
    if res.exc_info and not isinstance(res.exc_info[1], SystemExit):
        output += "".join(traceback.format_exception(res.exc_info[1]))
    return res.exit_code, output


def git_status() -> str:
    try:
        return subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        return ""


def fuzz(count: int, seed: int, root: Path, base_run: Path, limit: float = 20.0, show=print) -> dict:
    """Fuzz ``count`` command lines in workspaces under ``root``; returns the tally and the unclean cases."""
    import torch
    import typer.main
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    rng = random.Random(seed)
    runner = CliRunner()
    app_cmd = typer.main.get_command(app)
    before_git, cwd = git_status(), os.getcwd()
    unclean, timed_out = [], []
    for i in range(count):
        ws = root / f"case{i:03d}"
        workspace(ws, base_run)
        args = command_line(rng, app_cmd, ws)
        siblings = sorted(p.name for p in root.iterdir())
        env, threads = dict(os.environ), torch.get_num_threads()
        os.chdir(ws)
        try:
            t0 = time.perf_counter()
            code, output = run_case(runner, app, args, limit)
        finally:  # a case's --threads sets OMP_NUM_THREADS and torch's threads: not for the next case
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            torch.set_num_threads(threads)
        why = "timed out" if code is None else verdict(code, output)
        if why is None and sorted(p.name for p in root.iterdir()) != siblings:
            why = "wrote beside its workspace"
        if why is None and os.path.lexists(OUTSIDE):
            why = f"created {OUTSIDE}"
        if why == "timed out":
            timed_out.append(args)
        elif why is not None:
            unclean.append({"args": args, "code": code, "why": why, "output": output})
            show(f"UNCLEAN #{i}: cemtool {shlex.join(args)}\n  exit {code}: {why}\n  "
                 + "\n  ".join(output.strip().splitlines()[-12:]))
        shutil.rmtree(ws, ignore_errors=True)
        if os.environ.get("FUZZ_VERBOSE"):
            show(f"#{i} {time.perf_counter() - t0:.1f}s exit {code}: cemtool {shlex.join(args)[:150]}")
    if git_status() != before_git:
        unclean.append({"args": [], "code": None, "why": "the repository's git status changed", "output": ""})
        show("UNCLEAN: the repository's git status changed during the fuzzing")
    return {"fuzzed": count, "clean": count - len(unclean) - len(timed_out), "unclean": unclean,
            "timed_out": timed_out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=float, default=20.0, help="seconds per case")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CEMTOOL_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from bad_inputs import train_base

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cemtool-fuzz-") as tmp:
        base = train_base(Path(tmp))
        (Path(tmp) / "cases").mkdir()
        r = fuzz(a.count, a.seed, Path(tmp) / "cases", base, a.limit)
    for args in r["timed_out"]:
        print(f"timed out after {a.limit:.0f} s (not judged): cemtool {shlex.join(args)[:200]}")
    print(f"fuzzed {r['fuzzed']} / clean {r['clean']}  ({len(r['timed_out'])} timed out, not judged; "
          f"{time.perf_counter() - t0:.0f} s)")
    return 0 if not r["unclean"] else 1


if __name__ == "__main__":
    sys.exit(main())
