"""Copy a study tree (research/scripts/study.sh's runs/findings, or any folder of `cemtool sweep` studies) without
checkpoints, so that it can be committed and continued later.

    python research/scripts/light_copy.py SRC DEST

Every study directory (a folder with study.json) is copied with the runs of its finished items: config, meta,
metrics, tokenizer, reports and figures, and their fine-tunes' (forgetting) reports; never a checkpoint. An item is
finished when it trained and every analysis of the plan is done. Items that are not (a run cut short, an analysis
still pending, both of which need checkpoints to continue) are reset to pending in the copied study.json and their
folders are left out, so `cemtool sweep` (or research/scripts/study.sh) started on the copy retrains them from
scratch, to the same result: batches and initialisation are a pure function of the seed. Logs and selection.json
files are copied as they are, and so are the superseded-*/ folders of a re-planned comparison (the runs its
earlier choice trained, kept for the record; without checkpoints). DEST is replaced.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SKIP = {"checkpoints", ".lock", ".manifest.lock", ".claims"}  # never copied: weights, and the live studies' locks


def finished(item: dict) -> bool:
    return item.get("status") == "completed" and all(a.get("status") == "completed"
                                                     for a in item.get("analyses", {}).values())


def copy_run(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, ignore=lambda d, names: [n for n in names if n in SKIP or n.endswith(".tmp")])


def copy_study(src: Path, dest: Path) -> tuple[int, int]:
    """One study directory; returns (items kept, items reset)."""
    manifest = json.loads((src / "study.json").read_text())
    dest.mkdir(parents=True, exist_ok=True)
    kept = reset = 0
    runs = set()
    for item in manifest["items"]:
        if finished(item):
            kept += 1
            runs.add(item["run"])
            for a in item.get("analyses", {}).values():  # a fine-tune's folder sits beside the run
                report = a.get("report") or ""
                if "-ft-" in report:
                    runs.add(report.split("/")[0])
        else:
            reset += 1
            item.update(status="pending", error=None)
            for a in item.get("analyses", {}).values():
                a.update(status="pending", report=None, error=None)
    if reset:
        manifest["status"] = "incomplete"
    for entry in src.iterdir():
        if entry.is_dir() and (entry.name in runs or entry.name.startswith("superseded-")):
            copy_run(entry, dest / entry.name)  # (superseded-*/: the runs a re-planned comparison set aside)
        elif entry.is_file() and entry.name != "study.json" and entry.name not in SKIP:
            shutil.copy2(entry, dest / entry.name)
    (dest / "study.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return kept, reset


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python research/scripts/light_copy.py SRC DEST", file=sys.stderr)
        return 2
    src, dest = Path(argv[1]), Path(argv[2])
    studies = sorted(p.parent for p in src.rglob("study.json"))
    if not studies:
        print(f"Error: no study (study.json) under {src}", file=sys.stderr)
        return 1
    if dest.exists():
        shutil.rmtree(dest)
    for study in studies:
        kept, reset = copy_study(study, dest / study.relative_to(src))
        print(f"{study.relative_to(src)}: {kept} finished item(s) kept, {reset} reset to pending")
    for f in src.rglob("*"):  # logs, notes and sweeps beside the studies (study.log, DIR.log, the pydoc target
        # text, a saturation sweep's reports and run records), without their weights and locks
        rel = f.relative_to(src)
        if f.is_file() and not SKIP & set(rel.parts) and not f.name.endswith(".tmp") \
                and not any((src / p).is_dir() and (src / p / "study.json").exists() for p in [*rel.parents][:-1]):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest / rel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
