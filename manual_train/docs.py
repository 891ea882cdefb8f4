"""python -m manual_train.docs: render (or --check) the loop diff pages in docs/diffs/.

Teach by diff: every loop in manual_train/loops/ is its base loop (single.py; zero.py's is ddp.py)
plus lines marked with its technique's tag (docs/CONTRIBUTING-loops.md):

    # >>> DDP: why this block differs, and what it costs
    ...
    # <<< DDP
    changed_line()  # DDP: why

This module renders `diff base derived` per loop into docs/diffs/<loop>.md, one section per hunk,
with the hunk's marker reasons as its explanation, and checks two things tests/test_docs.py
enforces: the committed pages equal what the code renders now (they cannot go stale), and no loop
changes a line outside a marked block (the diff stays the lesson it claims to be).

    python -m manual_train.docs           # rewrite docs/diffs/*.md
    python -m manual_train.docs --check   # exit 1 listing stale pages and unmarked lines
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Loop:
    name: str  # manual_train/loops/<name>.py
    base: str  # the loop it is a diff of
    tag: str  # marker tag of its changes
    title: str
    intro: str


LOOPS = (
    Loop("data_parallel", "single", "DP", "DataParallel",
         "One process drives several devices: the module is replicated to each every step, the batch scattered, "
         "the outputs gathered on one device where the loss is computed (`launch/dp.py`, docs/data_parallel.md)."),
    Loop("model_parallel", "single", "MP", "Model parallelism",
         "The seq2seq model's encoder on one device and decoder on another, activations moved explicitly, "
         "optionally pipelined over micro-batches (`launch/mp.py`, docs/model_parallel.md)."),
    Loop("hybrid", "single", "HYBRID", "Hybrid DP + MP",
         "Model parallelism whose halves are each data-parallel (dp-mp), or split models replicated by DDP "
         "(ddp-mp) (`launch/hybrid.py`, docs/hybrid.md)."),
    Loop("ddp", "single", "DDP", "DistributedDataParallel",
         "One process per device under torchrun, gradients all-reduced during backward (`launch/ddp.py`, "
         "docs/ddp.md)."),
    Loop("zero", "ddp", "ZERO", "ZeRO sharding",
         "The DDP loop with optimizer state, gradients and parameters sharded across ranks by fairscale or "
         "torch (`launch/zero.py`, docs/zero.md). Its base is the DDP loop, so its diff shows ZeRO alone."),
)


def loop_lines(name: str, root: Path = REPO) -> list[str]:
    return (root / "manual_train" / "loops" / f"{name}.py").read_text().splitlines()


def marked_lines(lines: list[str], tag: str) -> set[int]:
    """Indices inside `# >>> TAG` ... `# <<< TAG` (markers included) or carrying a `# TAG` comment."""
    marked, inside = set(), False
    single = re.compile(rf"#\s*{re.escape(tag)}\b")
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(f"# >>> {tag}"):
            inside = True
        if inside or single.search(line):
            marked.add(i)
        if stripped.startswith(f"# <<< {tag}"):
            inside = False
    return marked


def unmarked_differences(base: list[str], derived: list[str], tag: str) -> list[str]:
    """Lines the derived loop adds or changes outside marked blocks, and baseline lines it removes
    without a marked block in their place. Blank lines are layout, not code."""
    marked, bad = marked_lines(derived, tag), []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, derived, autojunk=False).get_opcodes():
        if op in ("replace", "insert"):
            bad += [f"line {j + 1}: {derived[j].strip()}" for j in range(j1, j2)
                    if derived[j].strip() and j not in marked]
        elif op == "delete" and not ({j1 - 1, j1} & marked):
            bad += [f"removed base line {i + 1}: {base[i].strip()}" for i in range(i1, i2) if base[i].strip()]
    return bad


def reasons(lines: list[str], indices: range, tag: str) -> list[str]:
    """The marker explanations among `indices`: `# >>> TAG: text` plus its comment continuation lines,
    and `code  # TAG: text`."""
    out = []
    opener = re.compile(rf"#\s*>>>\s*{re.escape(tag)}:\s*(.*)")
    inline = re.compile(rf"#\s*{re.escape(tag)}:\s*(.*)")
    for j in indices:
        line = lines[j]
        m = opener.search(line)
        if m:
            text = [m.group(1).strip()]
            k = j + 1
            while k < len(lines) and lines[k].strip().startswith("#") and "<<<" not in lines[k] \
                    and ">>>" not in lines[k]:
                text.append(lines[k].strip().lstrip("#").strip())
                k += 1
            out.append(" ".join(t for t in text if t))
            continue
        if line.strip().startswith("#"):
            continue  # continuation lines were taken with their opener
        m = inline.search(line)
        if m and m.group(1).strip():
            out.append(m.group(1).strip())
    return [r for r in out if r]


def render(loop: Loop, root: Path = REPO) -> str:
    base, derived = loop_lines(loop.base, root), loop_lines(loop.name, root)
    matcher = difflib.SequenceMatcher(None, base, derived, autojunk=False)
    changed = sum(j2 - j1 for op, _, _, j1, j2 in matcher.get_opcodes() if op in ("replace", "insert"))
    out = [f"# {loop.title}: `loops/{loop.name}.py` as a diff of `loops/{loop.base}.py`", "",
           loop.intro, "",
           f"{changed} of its {len(derived)} lines differ from the base loop, all marked `{loop.tag}`. "
           f"Generated from the code by `python -m manual_train.docs`; do not edit by hand "
           f"(tests/test_docs.py fails when this page is out of date).", ""]
    for n, group in enumerate(matcher.get_grouped_opcodes(2), 1):
        j_first, j_last = group[0][3], group[-1][4]
        i_first, i_last = group[0][1], group[-1][2]
        out += [f"## {n}. `{loop.base}.py` {i_first + 1}-{i_last} → `{loop.name}.py` {j_first + 1}-{j_last}", ""]
        why = []
        for op, i1, i2, j1, j2 in group:
            if op in ("replace", "insert"):
                why += reasons(derived, range(j1, j2), loop.tag)
        if why:
            out += [f"- {w}" for w in why] + [""]
        out.append("```diff")
        for op, i1, i2, j1, j2 in group:
            if op == "equal":
                out += [f" {line}" for line in base[i1:i2]]
            else:
                out += [f"-{line}" for line in base[i1:i2]] + [f"+{line}" for line in derived[j1:j2]]
        out += ["```", ""]
    return "\n".join(out).rstrip() + "\n"


def page_path(loop: Loop, root: Path = REPO) -> Path:
    return root / "docs" / "diffs" / f"{loop.name}.md"


def existing_loops(root: Path = REPO) -> list[Loop]:
    return [loop for loop in LOOPS if (root / "manual_train" / "loops" / f"{loop.name}.py").exists()]


def problems(root: Path = REPO) -> list[str]:
    """Stale pages and unmarked lines, one line each (empty when all is well)."""
    found = []
    for loop in existing_loops(root):
        page = page_path(loop, root)
        if not page.exists() or page.read_text() != render(loop, root):
            found.append(f"{page.relative_to(root)} is out of date: run python -m manual_train.docs")
        found += [f"manual_train/loops/{loop.name}.py: unmarked {d}"
                  for d in unmarked_differences(loop_lines(loop.base, root), loop_lines(loop.name, root), loop.tag)]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m manual_train.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check; exit 1 on stale pages or unmarked lines")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        print("\n".join(found) if found else "docs/diffs is up to date and every loop change is marked")
        return 1 if found else 0
    for loop in existing_loops():
        page = page_path(loop)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render(loop))
        print(f"wrote {page.relative_to(REPO)}")
    for line in problems():
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
