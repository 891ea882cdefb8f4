"""python -m manual_train.docs: render (or --check) the loop diff pages in docs/diffs/.

Teach by diff: every loop in manual_train/loops/ is its base loop (single.py; zero.py's is ddp.py)
plus lines marked with its technique's tag (docs/CONTRIBUTING-loops.md):

    # >>> DDP: why this block differs, and what it costs
    ...
    # <<< DDP
    changed_line()  # DDP: why

This module renders `diff base derived` per loop into docs/diffs/<loop>.md, one section per hunk,
with the hunk's marker reasons as its explanation, and checks what tests/test_docs.py enforces: the
committed pages equal what the code renders now (they cannot go stale), no loop changes a line outside
a marked block (the diff stays the lesson it claims to be), and the lesson stays short to read: no
comment block of more than 3 lines inside a marked hunk, no loop docstring over 15 lines (the long why,
measurements and command lists belong on the technique's docs page).

    python -m manual_train.docs           # rewrite docs/diffs/*.md
    python -m manual_train.docs --check   # exit 1 listing stale pages and unmarked lines
    python -m manual_train.docs --stats   # the lesson budget: each loop's diff size, file and function lengths
    python -m manual_train.docs --html site-out            # the lessons as a static site (manual_train/site.py)
    python -m manual_train.docs --check --html site-out    # ... and exit 1 when that built site is stale

A lesson is small (docs/CONTRIBUTING-loops.md): --stats counts code lines (no blank lines, comments or
docstrings) and compares them with BUDGET; tests/test_docs.py holds the tree to it.
"""
from __future__ import annotations

import ast
import difflib
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Loop:
    name: str  # the technique's one name: loops/<name>.py, launch/<name>.py, SCRIPT, docs/<name>.md
    base: str  # the loop it is a diff of
    title: str
    intro: str

    @property
    def tag(self) -> str:
        """The marker tag of its changes: the name itself, in capitals (# >>> DATA_PARALLEL: ...)."""
        return self.name.upper()


LOOPS = (
    Loop("data_parallel", "single", "DataParallel",
         "One process drives several devices: the module is replicated to each every step, the batch scattered, "
         "the outputs gathered on one device where the loss is computed (`launch/data_parallel.py`, "
         "docs/data_parallel.md)."),
    Loop("model_parallel", "single", "Model parallelism",
         "The seq2seq model's encoder on one device and decoder on another, activations moved explicitly, "
         "optionally pipelined over micro-batches (`launch/model_parallel.py`, docs/model_parallel.md)."),
    Loop("hybrid", "single", "Hybrid DP + MP",
         "Model parallelism whose halves are each data-parallel (dp-mp), or split models replicated by DDP "
         "(ddp-mp) (`launch/hybrid.py`, docs/hybrid.md)."),
    Loop("ddp", "single", "DistributedDataParallel",
         "One process per device under torchrun, gradients all-reduced during backward (`launch/ddp.py`, "
         "docs/ddp.md)."),
    Loop("apex_o2", "single", "apex's O2",
         "apex's O2 written out (the first article's tip 7): an fp16 model with BatchNorm kept fp32, fp32 master "
         "weights in the optimizer, a dynamic loss scale, the fp16 gradients unscaled into the masters and the "
         "masters copied back after each step; `--precision apex-o2` lets apex.amp do it (`launch/apex_o2.py`, "
         "docs/apex_o2.md)."),
    Loop("pipeline", "single", "Pipeline parallelism",
         "The GPT's blocks split into stages, one per rank under torchrun, each batch cut into micro-batches: GPipe "
         "written out with send/recv, or torch.distributed.pipelining's gpipe, 1f1b, interleaved-1f1b; the same "
         "weights as the baseline, also for a batch that does not split evenly (`launch/pipeline.py`, "
         "docs/pipeline.md). Its base is the baseline: every stage reads the same batches (no data parallelism)."),
    Loop("zero", "ddp", "ZeRO sharding",
         "The DDP loop with optimizer state, gradients and parameters sharded across ranks by fairscale or "
         "torch (`launch/zero.py`, docs/zero.md). Its base is the DDP loop, so its diff shows ZeRO alone."),
    Loop("tensor_parallel", "zero", "Tensor parallelism (and 2-D FSDP2 x TP)",
         "The GPT's attention and MLP split column/row-wise over --tp ranks of a DeviceMesh, and FSDP2 over --dp "
         "replicas of that (`launch/tensor_parallel.py`, docs/tensor_parallel.md). Its base is the ZeRO loop."),
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


MAX_HUNK_COMMENT_LINES = 3  # consecutive comment lines inside a marked hunk; the long why goes to docs/<technique>.md
MAX_DOCSTRING_LINES = 15  # a loop module's docstring; long command lists and explanations go to its docs page


def long_hunk_comments(lines: list[str], tag: str) -> list[str]:
    """Runs of more than MAX_HUNK_COMMENT_LINES consecutive comment lines marked with `tag` (inside its
    `# >>> TAG` ... `# <<< TAG` block, or carrying `# TAG`), one line each. A closing marker ends a run."""
    marked, found, run = marked_lines(lines, tag), [], []
    for i, line in enumerate([*lines, ""]):
        stripped = line.strip()
        if i in marked and stripped.startswith("#") and not stripped.startswith(f"# <<< {tag}"):
            run.append(i)
            continue
        if len(run) > MAX_HUNK_COMMENT_LINES:
            found.append(f"lines {run[0] + 1}-{run[-1] + 1}: a comment block of {len(run)} lines in a marked hunk "
                         f"(at most {MAX_HUNK_COMMENT_LINES}; the long why goes to the technique's docs page)")
        run = []
    return found


def docstring_lines(text: str) -> int:
    """How many lines the module's docstring spans (0 without one). Reads only the first tokens, so a module that
    does not parse further down (an edit in progress) still gets its docstring counted."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENCODING):
            continue
        return tok.end[0] - tok.start[0] + 1 if tok.type == tokenize.STRING else 0
    return 0


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


# ---------------------------------------------------------------------- the lesson budget (--stats)
BUDGET = dict(
    changed_code_lines=90,  # a parallel loop's added + removed code lines against its parent
    tagged_share=0.80,  # of its added code lines, the share inside its own technique's markers
    loop_file_lines=300,  # any loop file, every line counted
    baseline_train_code_lines=120,  # single.py's train()
    function_code_lines=60,  # any other function in manual_train/ (the loops' own train functions excepted)
)
TRAIN_FUNCTIONS = ("train", "train_rank")  # a loop's own training function(s), exempt from the function budget


def code_line_numbers(text: str) -> set[int]:
    """1-based numbers of the lines that hold code: not blank, not only a comment, not in a docstring."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines -= set(range(first.lineno, first.end_lineno + 1))
    return lines


def diff_stats(loop: Loop, root: Path = REPO) -> dict:
    """Code lines the loop adds and removes against its base, and the share of the added ones marked with its tag."""
    base, derived = loop_lines(loop.base, root), loop_lines(loop.name, root)
    base_code = code_line_numbers("\n".join(base) + "\n")
    derived_code = code_line_numbers("\n".join(derived) + "\n")
    marked = marked_lines(derived, loop.tag)
    added = removed = tagged = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, base, derived, autojunk=False).get_opcodes():
        if op in ("replace", "insert"):
            new = [j for j in range(j1, j2) if j + 1 in derived_code]
            added += len(new)
            tagged += sum(j in marked for j in new)
        if op in ("replace", "delete"):
            removed += sum(i + 1 in base_code for i in range(i1, i2))
    return {"loop": loop.name, "base": loop.base, "added": added, "removed": removed,
            "changed": added + removed, "tagged_share": tagged / added if added else 1.0,
            "file_lines": len(derived)}


def long_functions(root: Path = REPO) -> list[tuple[str, int]]:
    """(module:function, code lines) of every function in manual_train/ over the budget, loops' train aside."""
    found = []
    for path in sorted((root / "manual_train").rglob("*.py")):
        text = path.read_text()
        code = code_line_numbers(text)
        in_loops = path.parent.name == "loops"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if in_loops and node.name in TRAIN_FUNCTIONS:
                    continue
                n = len(code & set(range(node.lineno, node.end_lineno + 1)))
                if n > BUDGET["function_code_lines"]:
                    found.append((f"{path.relative_to(root)}:{node.name}", n))
    return found


def baseline_train_code_lines(root: Path = REPO) -> int:
    text = (root / "manual_train" / "loops" / "single.py").read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "train")
    return len(code_line_numbers(text) & set(range(node.lineno, node.end_lineno + 1)))


def over_budget(root: Path = REPO) -> list[str]:
    """Every way the tree exceeds BUDGET, one line each (empty when the lessons are within it)."""
    found = []
    n = baseline_train_code_lines(root)
    if n > BUDGET["baseline_train_code_lines"]:
        found.append(f"loops/single.py train(): {n} code lines > {BUDGET['baseline_train_code_lines']}")
    for loop in existing_loops(root):
        st = diff_stats(loop, root)
        if st["changed"] > BUDGET["changed_code_lines"]:
            found.append(f"loops/{loop.name}.py: {st['changed']} changed code lines against {loop.base}.py "
                         f"> {BUDGET['changed_code_lines']}")
        if st["tagged_share"] < BUDGET["tagged_share"]:
            found.append(f"loops/{loop.name}.py: {st['tagged_share']:.0%} of its added code lines are marked "
                         f"{loop.tag} < {BUDGET['tagged_share']:.0%}")
        if st["file_lines"] > BUDGET["loop_file_lines"]:
            found.append(f"loops/{loop.name}.py: {st['file_lines']} lines > {BUDGET['loop_file_lines']}")
    found += [f"{name}: {n} code lines > {BUDGET['function_code_lines']}" for name, n in long_functions(root)]
    return found


def stats_table(root: Path = REPO) -> str:
    rows = ["| loop | parent | + code lines | - code lines | changed (budget 90) | marked with its tag | file lines |",
            "|---|---|---|---|---|---|---|"]
    for loop in existing_loops(root):
        st = diff_stats(loop, root)
        rows.append(f"| {loop.name} | {loop.base} | {st['added']} | {st['removed']} | {st['changed']} | "
                    f"{st['tagged_share']:.0%} | {st['file_lines']} |")
    rows.append(f"\nloops/single.py train(): {baseline_train_code_lines(root)} code lines "
                f"(budget {BUDGET['baseline_train_code_lines']})")
    over = over_budget(root)
    rows.append("\nover budget:\n" + "\n".join(f"- {line}" for line in over) if over else "\nwithin budget")
    return "\n".join(rows)


def page_path(loop: Loop, root: Path = REPO) -> Path:
    return root / "docs" / "diffs" / f"{loop.name}.md"


def existing_loops(root: Path = REPO) -> list[Loop]:
    return [loop for loop in LOOPS if (root / "manual_train" / "loops" / f"{loop.name}.py").exists()]


def problems(root: Path = REPO) -> list[str]:
    """Stale pages, unmarked lines, long comment blocks in marked hunks and long loop docstrings, one line each
    (empty when all is well)."""
    found = []
    for name in ["single", *(loop.name for loop in existing_loops(root))]:
        path = root / "manual_train" / "loops" / f"{name}.py"
        n = docstring_lines(path.read_text()) if path.exists() else 0
        if n > MAX_DOCSTRING_LINES:
            found.append(f"manual_train/loops/{name}.py: its docstring is {n} lines (at most {MAX_DOCSTRING_LINES}; "
                         f"move command lists and explanations to its docs page)")
    for loop in existing_loops(root):
        page = page_path(loop, root)
        if not page.exists() or page.read_text() != render(loop, root):
            found.append(f"{page.relative_to(root)} is out of date: run python -m manual_train.docs")
        found += [f"manual_train/loops/{loop.name}.py: unmarked {d}"
                  for d in unmarked_differences(loop_lines(loop.base, root), loop_lines(loop.name, root), loop.tag)]
        found += [f"manual_train/loops/{loop.name}.py: {d}" for d in long_hunk_comments(loop_lines(loop.name, root),
                                                                                         loop.tag)]
    return found
