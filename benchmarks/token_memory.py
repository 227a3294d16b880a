"""Peak memory of a pretokenised corpus is flat in its size: a small .bin and one 20x larger, same work.

    python benchmarks/token_memory.py [--tokens 10_000_000] [--factor 20] [--steps 200]

For each size a fresh process opens the file as `cemtool train --data FILE.bin` does (load_corpus: memory-map,
check every id against the vocabulary in chunks), then draws ``--steps`` training batches (32 x 256 tokens) and the
evaluation windows, and reports its peak resident set (VmHWM = ru_maxrss) and, at the end, its anonymous (private)
and file-backed resident memory. A baseline process does the same imports and nothing else. Each file is measured
twice: cold (not in the page cache, as after a reboot or for a corpus larger than RAM: the file's cached pages are
dropped with posix_fadvise after writing) and warm (the whole file read into the page cache first). Warm, the kernel
maps up to 64 KiB of already-cached file around each page a window touches (fault-around); those clean, shared
pages count in RSS and grow with the windows drawn up to the file's size, but they are page cache, reclaimed under
memory pressure, not memory the process holds. The files are random uint16 ids written in chunks to a temporary
folder and deleted afterwards. Prints a table; exit code 0 always (it reports, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = """
import json, resource, sys, time
from cemtool.config import DataConfig
from cemtool.data.corpus import batch_starts, load_corpus, windows
path, steps = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
if path != "-":
    corpus = load_corpus(DataConfig(source=path, seq_len=256, tokenizer="auto"))
    for step in range(steps):
        x, y = windows(corpus.train, batch_starts(corpus, 256, 32, 0, step), 256)
    x, y = windows(corpus.val, corpus.eval_windows(256, 32768), 256)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
mib = lambda key: int(status[key].split()[0]) / 1024 if key in status else None
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "anon_mib": mib("RssAnon"), "file_mib": mib("RssFile"), "seconds": time.perf_counter() - t0}))
"""


def write_tokens(path: Path, n: int, vocab: int = 50257, chunk: int = 1 << 22) -> None:
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for i in range(0, n, chunk):
            f.write(rng.integers(0, vocab, min(chunk, n - i), dtype=np.uint16).tobytes())


def set_cache(path: Path, warm: bool) -> None:
    """Drop the file's pages from the page cache (cold) or read it all in (warm)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        if warm:
            while f.read(1 << 24):
                pass
        elif hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def measure(path: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(steps)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=lambda s: int(s.replace("_", "")), default=10_000_000)
    ap.add_argument("--factor", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = [("imports only", 0, measure("-", args.steps))]
    with tempfile.TemporaryDirectory() as d:
        for n in (args.tokens, args.tokens * args.factor):
            p = Path(d) / f"tokens-{n}.bin"
            t0 = time.perf_counter()
            write_tokens(p, n)
            print(f"wrote {p.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            for cache in ("cold", "warm"):
                set_cache(p, cache == "warm")
                rows.append((f"{p.name} {cache}", p.stat().st_size, measure(str(p), args.steps)))
            p.unlink()
    print(f"{'file':<28} {'size MiB':>9} {'peak RSS MiB':>13} {'anon MiB':>9} {'file MiB':>9} {'seconds':>8}")
    for name, size, m in rows:
        print(f"{name:<28} {size / 2**20:>9,.0f} {m['peak_rss_mib']:>13,.0f} {m['anon_mib']:>9,.0f} "
              f"{m['file_mib']:>9,.0f} {m['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
