"""Rewrite `from cemtool.runs import ...` lines after the split of runs.py (one-off refactoring aid; kept so that a
branch made before the split can be brought up to date: python scripts/rehome_imports.py FILE...)."""

import re
import sys
from pathlib import Path

HOME = {}
for mod, names in {
    "cemtool.writes": "atomic_write_bytes atomic_write_text atomic_write_json os_error clean_stale_temps "
                      "refuse_symlinked_dirs safe_name to_json_value TMP_SUFFIX _alive",
    "cemtool.provenance": "versions git_commit now",
    "cemtool.checkpoints": "_sha256 model_tensors _flatten _key _unflatten save_checkpoint _content_sha256 "
                           "_refuse_pickle Checkpoint read_checkpoint _check_header load_weights check_fits "
                           "_optimizer_misfit restore_training resume_checkpoint manifest step_checkpoints "
                           "find_checkpoint",
    "cemtool.layout": "is_run is_hf_dir RUN_SUBDIRS RUN_FILES",
    "cemtool.fileio": "read_json read_jsonl check_regular",
}.items():
    for n in names.split():
        HOME[n] = mod

PATTERN = re.compile(r"^([ \t]*)from cemtool\.runs import (\([^)]*\)|[^\n]*)$", re.M)


def rewrite(text: str) -> str:
    def fix(m: re.Match) -> str:
        indent, body = m.group(1), m.group(2)
        comment = ""
        if not body.startswith("(") and "#" in body:
            body, comment = body.split("#", 1)
            comment = "  #" + comment
        names = [n.strip() for n in body.strip("()").replace("\n", " ").split(",") if n.strip()]
        groups: dict[str, list[str]] = {}
        for n in names:
            base = n.split(" as ")[0].strip()
            groups.setdefault(HOME.get(base, "cemtool.runs"), []).append(n)
        lines = [f"{indent}from {mod} import {', '.join(ns)}" for mod, ns in sorted(groups.items())]
        lines[0] += comment
        return "\n".join(lines)

    return PATTERN.sub(fix, text)


if __name__ == "__main__":
    for f in sys.argv[1:]:
        p = Path(f)
        old = p.read_text(encoding="utf-8")
        new = rewrite(old)
        if new != old:
            p.write_text(new, encoding="utf-8")
            print("rewrote", f)
