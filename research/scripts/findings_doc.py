"""Fill research/docs/findings.md's generated blocks from a study's findings.md (written by
research/scripts/findings.py).

    python research/scripts/findings_doc.py [FINDINGS_MD] [DOC]
        (defaults research/sample_runs/findings/findings.md and research/docs/findings.md, from the repository root)

The blocks are the text between `<!-- NAME -->` and `<!-- /NAME -->`; everything else in DOC is prose and is kept.
TABLE: the grammar part's verdict table and its details. TUNING: the learning rates chosen and the compute lines of
every part. MUON and PYDOC: those parts' tables and details (NOT_YET while the part has no finished comparison).
AGREE: where each part's verdicts agree with the grammar part's. REISSUED: every part's verdicts re-issued under the
second rules (research/scripts/verdicts_v2.py). research/tests/test_findings.py checks that
research/docs/findings.md equals what this writes from research/sample_runs/findings, so the document cannot
drift from the runs it cites.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FINDINGS = Path("research") / "sample_runs" / "findings"  # the study's light outputs, from the repository root
DOC = Path("research") / "docs" / "findings.md"
TABLE_INTRO = ("The grammar corpus, AdamW, each architecture at its tuned learning rate, 5 comparison seeds (printed "
               "by `python research/scripts/findings.py runs/findings`; the command behind each row is under "
               "\"Details\"):")
DETAILS = "**Details** (means ± std over seeds, and the `cemtool compare` command of each row):"
PART_TUNING = {"grammar-muon": "The Muon part (`train.muon_lr` for the blocks' matrices; AdamW at 3e-3 for the rest):",
               "pydoc": "The pydoc part (Python's documentation, BPE 1,024):",
               "stdlib": "The stdlib part (the standard library's source, BPE 1,024, >= 20 tokens per parameter; "
                         "finished tuning studies):"}


NOT_YET = "(No comparison of this part has finished yet.)"


def parts(generated: str) -> dict[str, str]:
    """The sections of research/scripts/findings.py's findings.md: one per part (`## NAME: ...`), and `agree`."""
    out = {}
    heads = list(re.finditer(r"^## (.+)$", generated, re.M))
    for m, nxt in zip(heads, heads[1:] + [None], strict=True):
        text = generated[m.start():nxt.start() if nxt else len(generated)]
        name = "agree" if m.group(1).startswith("Where the parts agree") else m.group(1).split(":")[0]
        if name in out:  # a later section of the same name (none today): keep the first
            continue
        out[name] = text
    return out


def pick(text: str, start: str, end: str | None = None) -> str:
    """The text from ``start`` up to ``end`` (or the end), stripped; empty when ``start`` is absent."""
    i = text.find(start)
    if i < 0:
        return ""
    j = text.find(end, i) if end else -1
    return text[i:j if j >= 0 else len(text)].strip()


def put(doc: str, name: str, text: str) -> str:
    """DOC with block NAME's text replaced (a DOC without the block is returned as it is)."""
    pat = re.compile(rf"<!-- {name} -->.*?<!-- /{name} -->|<!-- {name} -->", re.S)
    return pat.sub(lambda m: f"<!-- {name} -->\n{text}\n<!-- /{name} -->", doc, count=1)


def part_table(p: str) -> str:
    return (pick(p, "| claim |", "\nDetails:") + "\n\n" +
            pick(p, "Details:", "Runs per group:").replace("Details:", "**Details:**", 1))


def fill(doc: str, generated: str) -> str:
    """DOC with its generated blocks replaced by what ``generated`` (a findings.md) says."""
    ps = parts(generated)
    g = ps.get("grammar")
    if g is None:
        raise ValueError("the findings have no grammar part")
    doc = put(doc, "TABLE", TABLE_INTRO + "\n\n" + pick(g, "| claim |", "\nDetails:") + "\n\n" +
              pick(g, "Details:", "Runs per group:").replace("Details:", DETAILS, 1))
    tuning = pick(g, "Learning rates chosen", "Compute:") + "\n\n" + pick(g, "Compute:")
    for name, intro in PART_TUNING.items():
        if name in ps and pick(ps[name], "| group |"):
            tuning += "\n\n" + intro + "\n\n" + pick(ps[name], "| group |", "Compute:") + "\n\n" + \
                pick(ps[name], "Compute:")
    doc = put(doc, "TUNING", tuning)
    for name, marker in (("grammar-muon", "MUON"), ("pydoc", "PYDOC")):
        doc = put(doc, marker, part_table(ps[name]) if name in ps else NOT_YET)
    doc = put(doc, "AGREE", pick(ps["agree"], "Each claim's verdict") if "agree" in ps else NOT_YET)
    again = next((text for name, text in ps.items() if name.startswith("Re-issued verdicts")), None)
    return put(doc, "REISSUED", pick(again, "### ") if again else NOT_YET)


def main(argv: list[str]) -> int:
    gen = Path(argv[1]) if len(argv) > 1 else FINDINGS / "findings.md"
    doc = Path(argv[2]) if len(argv) > 2 else DOC
    try:
        new = fill(doc.read_text(encoding="utf-8"), gen.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    doc.write_text(new, encoding="utf-8")
    print(f"{doc}: filled from {gen}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
