"""The lessons as a static site: `python -m manual_train.docs --html OUT` (make site).

One page per technique loop: its diff against its parent side by side (unified on a narrow screen), every hunk
beside its note (the hunk's own marker comments and the paragraph of docs/<technique>.md that explains its code),
and under each hunk the tests that prove it (what each compares, the distance it measured under a mutant against its
bound): the tests that kill a mutant of the hunk or of the package code it calls, else the technique's parity checks,
labelled as proving the whole loop; and the catalogue's mutants that break it (their diff, the kill distance, what
a user sees: docs/bug-gallery.md). Every page of docs/ is rendered beside them, its links rewritten to the rendered
pages, so the site reads offline from file://.

A hunk's docs note is chosen by the docs, not guessed: a paragraph or list item of docs/<technique>.md names the code
it explains in an HTML comment, invisible once rendered, on its own line above a paragraph (it belongs to the next
paragraph under the same heading) or at the end of a list item: `<!-- explains: shard(sync_batchnorm(, ZeroConfig -->`.
A hunk gets the first such unit, in page order, with a string written on one of the hunk's changed lines (code or
marker comment, not inside a longer name); none, no note (no note is better than a wrong one). Sections that explain
no code (tests, measurements, resume) claim nothing. `--check` reports a string that no hunk of its lesson writes.

Built from the code and the committed pages only: the loops (manual_train/loops/), docs/*.md, the tests' own
functions (tests/test_*.py, read with ast) and the mutant catalogue (tests/mutants/, with the kill matrix
docs/mutants.md and the gallery docs/bug-gallery.md for what was measured). Nothing is measured here.

`render_site()` returns every file as text, so `--check --html OUT` can tell a stale built site from a fresh one,
and `site_problems()` lists what would make the site wrong: a link or anchor that resolves nowhere, a test or mutant
name that does not exist, a mutant whose code is no longer in the tree, a gallery or kill matrix that does not name
the catalogue's mutants, an `explains:` string that no hunk of its lesson writes.
"""
from __future__ import annotations

import ast
import difflib
import functools
import html
import importlib
import io
import re
import shutil
import sys
import tokenize
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from manual_train.docs import LOOPS, REPO, Loop, existing_loops, loop_lines, reasons

TEMPLATES = Path(__file__).resolve().parent / "site_templates"
# The catalogue's technique names that are a loop's (the others, precision and resume, are the baseline's or apex's).
TECHNIQUE_LOOP = {"dataparallel": "data_parallel", "model-parallel": "model_parallel", "hybrid": "hybrid",
                  "ddp": "ddp", "zero": "zero", "pipeline": "pipeline", "tensor-parallel": "tensor_parallel"}
TEST_REF = re.compile(r"tests/(test_\w+)\.py::(\w+)(\[[^\]]*\])?")


def _imports():
    """Jinja2, Pygments and Markdown: the `site` extra (pip install -e '.[site]'), imported only to build the site."""
    try:
        import jinja2
        import markdown
        import pygments  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"error: --html: needs {e.name} (allowed: pip install -e '.[site]')") from None
    return jinja2, markdown


def slug(text: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (docs link to them so)."""
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


# ---------------------------------------------------------------------- what the site is made of
@dataclass
class TestRef:
    node: str  # tests/test_x.py::test_name (no parametrization)
    file: str
    name: str
    doc: str  # its docstring: what it compares
    line: int
    bound: str = ""  # the bound its code asserts (asserted_bound), "" where it names none this site knows
    claims: list = field(default_factory=list)  # the docs' "which test proves what" rows naming it
    kills: list = field(default_factory=list)  # (mutant name, distance) from docs/mutants.md

    @property
    def anchor(self) -> str:
        return self.node


def source_segments(source: str):
    """A function node -> ast.get_source_segment(source, node), the file's lines split once: the stdlib's splits the
    whole file again on every call, quadratic in a file's length (read_tests: ~3 of the 4.5 CPU s of a site build;
    tests/flag_mutants.py: 8.7 s per reading of the tests, 2-core EPYC, 2026-12-06)."""
    lines = [line.encode() for line in re.split(r"(?<=\r\n)|(?<=\r)(?!\n)|(?<=\n)", source)]  # as ast splits: no \f

    def segment(node) -> str | None:
        if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
            return None
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return lines[first][node.col_offset:node.end_col_offset].decode()
        return b"".join([lines[first][node.col_offset:], *lines[first + 1:last],
                         lines[last][:node.end_col_offset]]).decode()
    return segment


def read_tests(root: Path) -> dict[str, TestRef]:
    """Every test function of tests/test_*.py, by node id (module-level and class methods)."""
    found = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        text = path.read_text()
        segment = source_segments(text)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                rel = f"tests/{path.name}"
                found[f"{rel}::{node.name}"] = TestRef(
                    f"{rel}::{node.name}", rel, node.name, " ".join((ast.get_docstring(node) or "").split()),
                    node.lineno, asserted_bound(segment(node)))
    return found


def asserted_bound(source: str) -> str:
    """The bound a test's code asserts on a weight distance, read from the check it calls (tests/conftest.py):
    the fp32 noise-floor check, the 64-true one, or a "(bound X)" in its own message; "" for none of these."""
    if "assert_within_fp32_floor" in source:
        return "10 x the fp32 noise floor measured in the test"
    if "assert_cross_path_64" in source or "PARITY_TOL_64" in source:
        return "1e-9 (64-true)"
    m = re.search(r"\(bound ([-+.\w]+)\)", source)
    return m.group(1) if m else ""


def load_catalogue(root: Path) -> list:
    """The mutant catalogue of tests/mutants/ (empty where tests/ is not there: an installed package)."""
    if not (root / "tests" / "mutants" / "__init__.py").exists():
        return []
    # Imported afresh from this root's tests/, and whatever `mutants` was loaded before is put back afterwards.
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "mutants" or k.startswith("mutants.")}
    sys.path.insert(0, str(root / "tests"))
    try:
        return importlib.import_module("mutants").catalogue()
    finally:
        sys.path.remove(str(root / "tests"))
        for k in [k for k in sys.modules if k == "mutants" or k.startswith("mutants.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def kill_matrix_rows(root: Path) -> dict[str, dict]:
    """docs/mutants.md's rows by mutant: the test that killed it and the distance it reported."""
    rows = {}
    path = root / "docs" / "mutants.md"
    for line in path.read_text().splitlines() if path.exists() else []:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 6 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = {"test": cells[3].strip("`"), "distance": cells[4]}
    return rows


def gallery_entries(root: Path) -> dict[str, str]:
    """docs/bug-gallery.md by mutant: what a user sees (the entry's paragraphs after its diff, `Caught by` aside)."""
    path = root / "docs" / "bug-gallery.md"
    entries, name, after_diff, fence = {}, None, False, False
    for line in path.read_text().splitlines() if path.exists() else []:
        m = re.match(r"### `([^`]+)`", line)
        if m:
            name, after_diff, fence = m.group(1), False, False
            entries[name] = []
            continue
        if line.startswith("#"):
            name = None
        if name is None:
            continue
        if line.startswith("```"):
            fence = not fence
            after_diff = after_diff or not fence
            continue
        if after_diff and not fence and line.strip() and not line.startswith("Caught by"):
            entries[name].append(line)
    return {k: "\n".join(v) for k, v in entries.items()}


def docs_claims(root: Path) -> dict[str, list[tuple[str, str]]]:
    """Test node -> [(docs page, claim)] from every docs table row that names a test next to what it proves."""
    claims = {}
    for page in sorted((root / "docs").glob("*.md")):
        for line in page.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")[1:-1]]
            if len(cells) < 2 or cells[0].startswith("---"):
                continue
            for m in TEST_REF.finditer(" ".join(cells[1:])):
                claims.setdefault(f"tests/{m.group(1)}.py::{m.group(2)}", []).append((page.name, cells[0]))
    return claims


def mutant_diff(root: Path, mutant) -> list[str]:
    text = (root / mutant.file).read_text()
    before, after = text.splitlines(), text.replace(mutant.old, mutant.new).splitlines()
    return list(difflib.unified_diff(before, after, n=1, lineterm=""))[2:]


def mutant_lines(root: Path, mutant) -> range | None:
    """0-based line indices of the mutant's `old` in its file (None when it is not there once)."""
    text = (root / mutant.file).read_text()
    if text.count(mutant.old) != 1:
        return None
    first = text[:text.index(mutant.old)].count("\n")
    return range(first, first + mutant.old.count("\n") + 1)


# ---------------------------------------------------------------------- markdown pages
class _Markdown:
    """docs/*.md to HTML: fenced code highlighted by Pygments, tables, GitHub's heading anchors, and links to
    another page (x.md#a) rewritten to its rendered page (x.html#a); `depth` is the page's folder depth in OUT."""

    def __init__(self, markdown):
        self.md = markdown.Markdown(extensions=["fenced_code", "tables", "codehilite", "toc", "sane_lists"],
                                    extension_configs={"codehilite": {"guess_lang": False, "css_class": "hl"},
                                                       "toc": {"slugify": lambda t, sep: slug(t)}})

    def __call__(self, text: str, depth: int = 0) -> str:
        self.md.reset()
        out = self.md.convert(text)
        prefix = "../" * depth

        def fix(m):
            href = m.group(2)
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or not parts.path.endswith(".md"):
                return m.group(0)
            return f'{m.group(1)}{prefix}{parts.path[:-3]}.html{"#" + parts.fragment if parts.fragment else ""}"'

        return re.sub(r'(<a href=")([^"]+)"', fix, out)


def doc_units(text: str) -> list[tuple[str, str]]:
    """(heading, paragraph or list item) of a docs page, code blocks and tables left out: the units a hunk's note
    is chosen from. An `explains:` comment alone in its block belongs to the next unit under the same heading."""
    units, heading, block, fence, pending = [], "", [], False, []

    def flush():
        if block:
            text = "\n".join(block)
            if EXPLAINS.sub("", text).strip():
                units.append((heading, "\n".join(pending + [text])))
                pending.clear()
            else:
                pending.append(text)
            block.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            fence = not fence
            continue
        if fence:
            continue
        if line.startswith("#"):
            flush()
            pending.clear()
            heading = line.lstrip("#").strip()
        elif not line.strip() or line.lstrip().startswith("|"):
            flush()
        elif re.match(r"\s*([-*]|\d+\.)\s", line) and not line.startswith("  "):
            flush()
            block.append(line)
        else:
            block.append(line)
    flush()
    return units


EXPLAINS = re.compile(r"<!--\s*explains:(.*?)-->", re.S)


def explains(unit_text: str) -> list[str]:
    """The code a docs unit says it explains: the comma-separated strings of its `<!-- explains: ... -->`."""
    return [s.strip() for m in EXPLAINS.finditer(unit_text) for s in m.group(1).split(",") if s.strip()]


def written_on(claim: str, lines: list[str]) -> bool:
    """Whether `claim` is written on one of `lines`, not as part of a longer name (`shard(` is not in `reshard(`)."""
    pattern = (r"(?<!\w)" if claim[0].isalnum() or claim[0] == "_" else "") + re.escape(claim) + \
        (r"(?!\w)" if claim[-1].isalnum() or claim[-1] == "_" else "")
    return any(re.search(pattern, line) for line in lines)


def doc_note(changed: list[str], units: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The docs unit that explains a hunk: the first, in page order, whose `explains:` names code written on the
    hunk's changed lines (its new side); None when none does (no note rather than a guessed one)."""
    return next(((heading, EXPLAINS.sub("", text).strip()) for heading, text in units
                 if any(written_on(c, changed) for c in explains(text))), None)


def hunk_groups(base: list[str], derived: list[str]) -> list[list[tuple]]:
    """The lesson's hunks: difflib's grouped opcodes, two lines of context."""
    return list(difflib.SequenceMatcher(None, base, derived, autojunk=False).get_grouped_opcodes(2))


def changed_lines(group, derived: list[str]) -> list[str]:
    """A hunk's changed lines on the new side."""
    return [derived[j] for op, _, _, j1, j2 in group if op != "equal" for j in range(j1, j2)]


def stale_explains(loop: Loop, root: Path) -> list[str]:
    """The `explains:` strings of docs/<loop>.md written on no hunk of its lesson, one line each."""
    doc_path = root / "docs" / f"{loop.name}.md"
    if not doc_path.exists():
        return []
    derived = loop_lines(loop.name, root)
    hunks = [changed_lines(g, derived) for g in hunk_groups(loop_lines(loop.base, root), derived)]
    return [f"docs/{loop.name}.md: <!-- explains: {c} --> (\"{heading}\"): no hunk of the {loop.name} lesson "
            f"changes a line with it" for heading, text in doc_units(doc_path.read_text())
            for c in explains(text) if not any(written_on(c, h) for h in hunks)]


# ---------------------------------------------------------------------- the lesson pages
def highlighted_lines(lines: list[str]) -> list[str]:
    """Pygments' HTML for each line of a Python file (its spans close at every line end)."""
    return list(_highlighted("\n".join(lines) + "\n"))[:len(lines)]


@functools.lru_cache(maxsize=32)
def _highlighted(text: str) -> tuple[str, ...]:  # the base loops are every lesson's left side: lexed once
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    out = highlight(text, PythonLexer(), HtmlFormatter(nowrap=True)).split("\n")
    return tuple(out) + ("",) * max(0, text.count("\n") - len(out))


def hunk_rows(group, base_hl, derived_hl):
    """Side-by-side rows (left number, left html, right number, right html, kind) and unified rows of one hunk."""
    side, unified = [], []
    for op, i1, i2, j1, j2 in group:
        if op == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                side.append((i + 1, base_hl[i], j + 1, derived_hl[j], "same"))
                unified.append((i + 1, j + 1, " ", derived_hl[j], "same"))
            continue
        left, right = list(range(i1, i2)), list(range(j1, j2))
        for k in range(max(len(left), len(right))):
            i = left[k] if k < len(left) else None
            j = right[k] if k < len(right) else None
            side.append((i + 1 if i is not None else "", base_hl[i] if i is not None else "",
                         j + 1 if j is not None else "", derived_hl[j] if j is not None else "", "changed"))
        unified += [(i + 1, "", "-", base_hl[i], "minus") for i in left]
        unified += [("", j + 1, "+", derived_hl[j], "plus") for j in right]
    return side, unified


def lesson(loop: Loop, root: Path, ctx: dict) -> dict:
    """Everything one technique page shows."""
    from markupsafe import Markup

    base, derived = loop_lines(loop.base, root), loop_lines(loop.name, root)
    base_hl = [Markup(h) for h in highlighted_lines(base)]
    derived_hl = [Markup(h) for h in highlighted_lines(derived)]
    doc_path = root / "docs" / f"{loop.name}.md"
    units = doc_units(doc_path.read_text()) if doc_path.exists() else []
    file = f"manual_train/loops/{loop.name}.py"
    technique = [t for t, name in TECHNIQUE_LOOP.items() if name == loop.name]
    page = [m for m in ctx["mutants"] if m.technique in technique or m.file == file]  # every mutant this page shows
    here = [m for m in page if m.file == file]
    placed = {m.name: mutant_lines(root, m) for m in here}
    # A hunk's tests: those that kill a mutant of its lines, then those that kill a mutant of the package code it
    # calls (a mutant edits the function or class the call names, or one that calls by name in turn, in that file).
    calls, calls_at = library_calls(root, file), written_calls(derived)
    reached_by = {m.name: {c for c, (f, name) in calls.items()
                          if f == m.file and owner(root, m) in reaches(root / f, name)}
                  for m in page if m.file != file}
    # Where there are none, the whole loop's: the technique's parity checks, the tests the kill matrix credits with a
    # weight distance for one of this page's mutants (docs/mutants.md measures one only for a check of trained weights).
    killer = {name: t.node for t in ctx["tests"].values() for name, d in t.kills if d != "-"}
    parity = [ctx["tests"][node] for node in dict.fromkeys(killer[m.name] for m in page if m.name in killer)]
    matcher = difflib.SequenceMatcher(None, base, derived, autojunk=False)
    hunks, used = [], set()
    for n, group in enumerate(hunk_groups(base, derived), 1):
        j_first, j_last = group[0][3], group[-1][4]
        changed = [j for op, _, _, j1, j2 in group if op != "equal" for j in range(j1, j2)]
        why = []
        for op, i1, i2, j1, j2 in group:
            if op in ("replace", "insert"):
                why += reasons(derived, range(j1, j2), loop.tag)
        unit = doc_note(changed_lines(group, derived), units)
        mutants = [m for m in here if placed[m.name] and set(placed[m.name]) & set(range(j_first, j_last))]
        used |= {m.name for m in mutants}
        called = sorted({c for j in changed for c in calls_at.get(j, ())} & set(calls))
        through = [m for m in page if reached_by.get(m.name, set()) & set(called)]
        via = [c for c in called if any(c in reached_by[m.name] for m in through)]
        tests = tests_for(mutants, ctx, loop)
        tests += [t for t in tests_for(through, ctx, loop, via=via) if t["test"] not in [u["test"] for u in tests]]
        side, unified = hunk_rows(group, base_hl, derived_hl)
        hunks.append(dict(
            n=n, anchor=f"hunk-{n}", title=f"{loop.base}.py {group[0][1] + 1}-{group[-1][2]} → "
                                          f"{loop.name}.py {j_first + 1}-{j_last}",
            why=why, doc=unit and dict(heading=unit[0], anchor=slug(unit[0]),
                                       html=Markup(ctx["md"](unit[1], depth=1))),
            side=side, unified=unified, mutants=[mutant_view(m, root, ctx) for m in mutants],
            tests=tests, whole=[] if tests else [test_view(t, page, loop) for t in parity]))
    library = [mutant_view(m, root, ctx) for m in page if m.name not in used]
    return dict(tech=loop, hunks=hunks, library=library, doc_page=f"{loop.name}.html" if units else None,
                changed=sum(j2 - j1 for op, _, _, j1, j2 in matcher.get_opcodes() if op in ("replace", "insert")),
                lines=len(derived), proofs=proof_table(loop, root, ctx))


def library_calls(root: Path, loop_file: str) -> dict[str, tuple[str, str]]:
    """What a loop calls in the package, as the call is written -> (file, top-level name): `f` for
    `from manual_train.x import f`, `x.f` for each top-level def or class f of x after `from manual_train import x`."""
    calls = {}
    for node in ast.parse((root / loop_file).read_text()).body:
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("manual_train"):
            continue
        for alias in node.names:
            if node.module == "manual_train" and (root / "manual_train" / f"{alias.name}.py").exists():
                f = f"manual_train/{alias.name}.py"
                calls.update({f"{alias.asname or alias.name}.{d}": (f, d) for d in _defs(root / f)})
            elif node.module != "manual_train":
                calls[alias.asname or alias.name] = (node.module.replace(".", "/") + ".py", alias.name)
    return calls


def written_calls(lines: list[str]) -> dict[int, set[str]]:
    """The calls written on each line (0-based) of Python source: `f(` as f, `x.f(` as x.f (strings and comments
    are no calls)."""
    return _written_calls("\n".join(lines) + "\n")


@functools.lru_cache(maxsize=32)
def _written_calls(text: str) -> dict[int, set[str]]:
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type in (tokenize.NAME, tokenize.OP)]
    out = {}
    for before, dot, name, paren in zip([None, None] + toks, [None] + toks, toks, toks[1:]):
        if paren.string == "(" and name.type == tokenize.NAME:
            dotted = dot is not None and dot.string == "." and before is not None and before.type == tokenize.NAME
            out.setdefault(name.start[0] - 1, set()).add(f"{before.string}.{name.string}" if dotted else name.string)
    return out


def _defs(path: Path) -> dict[str, ast.AST]:
    """A module's top-level functions and classes by name ({} where the file is not there)."""
    return _top_level(path.read_text() if path.exists() else "")


@functools.lru_cache(maxsize=64)
def _top_level(text: str) -> dict[str, ast.AST]:
    return {n.name: n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def reaches(path: Path, name: str) -> set[str]:
    """The top-level functions and classes of `path` that `name` runs: itself, what it calls by name, and so on."""
    defs, seen, todo = _defs(path), set(), [name]
    while todo:
        n = todo.pop()
        if n in defs and n not in seen:
            seen.add(n)
            todo += [c.func.id for c in ast.walk(defs[n]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    return seen


def owner(root: Path, mutant) -> str | None:
    """The top-level function or class of its file that a mutant edits (None: module-level code)."""
    lines = mutant_lines(root, mutant)
    return next((name for name, node in _defs(root / mutant.file).items()
                 if lines and node.lineno - 1 <= lines[0] < node.end_lineno), None)


def proof_table(loop: Loop, root: Path, ctx: dict) -> list[dict]:
    """The technique page's "which test proves what" rows, each test linked to the tests page."""
    rows = []
    for node, claims in ctx["claims"].items():
        for page, claim in claims:
            if page == f"{loop.name}.md" and node in ctx["tests"]:
                rows.append(dict(claim=claim, test=ctx["tests"][node]))
    return rows


def tests_for(mutants: list, ctx: dict, loop: Loop, via: list = ()) -> list[dict]:
    """The tests that kill these mutants, once each, with what they compare and the distances they reported
    (`via`: the calls of the hunk through which it reaches these mutants' code)."""
    out, seen = [], set()
    for m in mutants:
        for node in m.kill:
            key = TEST_REF.search(node)
            ref = ctx["tests"].get(f"tests/{key.group(1)}.py::{key.group(2)}") if key else None
            if ref is None or ref.node in seen:
                continue
            seen.add(ref.node)
            out.append(test_view(ref, mutants, loop, via))
    return out


def test_view(ref: TestRef, mutants: list, loop: Loop, via: list = ()) -> dict:
    """A test as a hunk lists it: what it compares (the claim of this technique's page first, else any page's) and
    the distances the kill matrix measured under these mutants."""
    own = [c for p, c in ref.claims if p == f"{loop.name}.md" and not c.startswith("...")]
    names = {m.name for m in mutants}
    return dict(test=ref, claim=own[0] if own else ref.doc or next((c for _, c in ref.claims), ""), via=list(via),
                kills=[(n, d) for n, d in ref.kills if n in names and d != "-"],
                mutants=sorted(n for n, _ in ref.kills if n in names))


def mutant_view(m, root: Path, ctx: dict) -> dict:
    from markupsafe import Markup
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import DiffLexer

    row = ctx["matrix"].get(m.name, {})
    seen = ctx["gallery"].get(m.name, "")
    return dict(name=m.name, says=m.says, report=m.report, file=m.file, test=row.get("test", ""),
                distance=row.get("distance", "-"),
                diff=Markup(highlight("\n".join(mutant_diff(root, m)) + "\n", DiffLexer(), HtmlFormatter(
                    cssclass="hl"))),
                sees=Markup(ctx["md"](seen, depth=1)) if seen else "")


# ---------------------------------------------------------------------- the whole site
def context(root: Path) -> dict:
    _, markdown = _imports()
    tests = read_tests(root)
    claims = docs_claims(root)
    matrix = kill_matrix_rows(root)
    for node, rows in claims.items():
        if node in tests:
            tests[node].claims = rows
    for name, row in matrix.items():
        key = TEST_REF.search(row["test"])
        ref = tests.get(f"tests/{key.group(1)}.py::{key.group(2)}") if key else None
        if ref:
            ref.kills.append((name, row["distance"]))
    return dict(tests=tests, claims=claims, matrix=matrix, gallery=gallery_entries(root),
                mutants=load_catalogue(root), md=_Markdown(markdown))


def render_site(root: Path = REPO) -> dict[str, str]:
    """Every file of the site, by its path relative to OUT (text; docs/img's images are copied by build())."""
    jinja2, _ = _imports()
    from pygments.formatters import HtmlFormatter

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    ctx = context(root)
    loops = existing_loops(root)
    index = (root / "docs" / "index.md").read_text() if (root / "docs" / "index.md").exists() else ""
    order = {name: i for i, name in enumerate(re.findall(r"diffs/(\w+)\.md", index)[::-1])}  # the first mention wins
    loops.sort(key=lambda loop: -order.get(loop.name, -len(loops) - 1))  # docs/index.md's reading order
    nav = [dict(title=loop.title, href=f"diffs/{loop.name}.html") for loop in loops]
    files = {"static/site.css": (TEMPLATES / "site.css").read_text(),
             "static/pygments.css": HtmlFormatter(style="friendly").get_style_defs(".hl")}
    common = dict(nav=nav)
    for page in sorted((root / "docs").glob("*.md")):
        name = page.stem
        body = ctx["md"](page.read_text(), depth=0)
        out = "index.html" if name == "index" else f"{name}.html"
        title = page.read_text().splitlines()[0].lstrip("# ").strip() if page.read_text() else name
        files[out] = env.get_template("page.html").render(
            root="", title=title, body=jinja2.filters.Markup(body), source=f"docs/{page.name}", **common)
    for loop in loops:
        files[f"diffs/{loop.name}.html"] = env.get_template("lesson.html").render(
            root="../", title=f"{loop.title}: the lesson", source=f"manual_train/loops/{loop.name}.py",
            **lesson(loop, root, ctx), **common)
    used = sorted({n for n, t in ctx["tests"].items() if t.claims or t.kills})
    files["tests.html"] = env.get_template("tests.html").render(
        root="", title="The tests that prove the lessons", source="tests/",
        tests=[ctx["tests"][n] for n in used], **common)
    return files


def refusal(out: Path) -> str:
    """Why `out` may not take the site ("" when it may): a file, or a folder with other things than a site."""
    if out.exists() and not out.is_dir():
        return f"{out} is a file (allowed: a new folder or one that holds a site)"
    if out.is_dir() and not (out / "index.html").exists() and any(out.iterdir()):
        return f"{out} is not empty and holds no site (allowed: a new folder or one that holds a site)"
    return ""


def build(out: Path, root: Path = REPO) -> dict[str, str]:
    """Write the site to `out` (replacing a site there); returns its files as render_site() gave them."""
    files = render_site(root)
    if out.exists():
        if refusal(out):
            raise ValueError(refusal(out))
        shutil.rmtree(out)
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    img = root / "docs" / "img"
    if img.is_dir():
        shutil.copytree(img, out / "img")
    return files


# ---------------------------------------------------------------------- checks
class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.hrefs = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key):
                self.hrefs.append(a[key])


def broken_links(files: dict[str, str], extra: set[str] = frozenset()) -> list[str]:
    """Internal links and anchors of the rendered site that resolve nowhere, one line each (`extra`: files the site
    copies, e.g. images)."""
    parsed = {}
    for rel, text in files.items():
        if rel.endswith(".html"):
            p = _Links()
            p.feed(text)
            parsed[rel] = p
    found = []
    for rel, p in parsed.items():
        for href in p.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc:
                continue
            target = (Path(rel).parent / unquote(parts.path)).as_posix() if parts.path else rel
            target = _normalise(target)
            if target not in files and target not in extra:
                found.append(f"{rel}: link to {href}: no such page")
            elif parts.fragment and target in parsed and unquote(parts.fragment) not in parsed[target].ids:
                found.append(f"{rel}: link to {href}: no such anchor")
    return found


def _normalise(path: str) -> str:
    out = []
    for part in path.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part not in ("", "."):
            out.append(part)
    return "/".join(out)


def site_problems(root: Path = REPO, files: dict[str, str] | None = None) -> list[str]:
    """What would make the site wrong, one line each (empty when it would be right); `files`: the site as
    render_site(root) returned it, where the caller has it."""
    files = render_site(root) if files is None else files
    images = {f"img/{p.name}" for p in (root / "docs" / "img").glob("*")} if (root / "docs" / "img").is_dir() else set()
    found = [f"site: {line}" for line in broken_links(files, images)]
    tests = read_tests(root)
    mutants = load_catalogue(root)
    matrix, gallery = kill_matrix_rows(root), gallery_entries(root)
    for m in mutants:
        if mutant_lines(root, m) is None:
            found.append(f"tests/mutants: {m.name}: its code is not in {m.file} once (the site cannot place it)")
        for node in m.kill:
            key = TEST_REF.search(node)
            if not key or f"tests/{key.group(1)}.py::{key.group(2)}" not in tests:
                found.append(f"tests/mutants: {m.name}: kill test {node} does not exist")
        if m.name not in matrix:
            found.append(f"docs/mutants.md does not name mutant {m.name}: run make mutants")
        if m.demo and m.name not in gallery:
            found.append(f"docs/bug-gallery.md has no entry for mutant {m.name}: run make mutants")
    for loop in existing_loops(root):
        found += stale_explains(loop, root)
    names = {m.name for m in mutants}
    if mutants:
        found += [f"docs/mutants.md names {n}, which the catalogue has not: run make mutants"
                  for n in sorted(set(matrix) - names)]
    return found


def stale_files(out: Path, root: Path = REPO, files: dict[str, str] | None = None) -> list[str]:
    """The files of a built site in `out` that differ from what the tree renders now, or are missing."""
    files = render_site(root) if files is None else files
    found = [f"{out / rel}: out of date" for rel, text in files.items()
             if not (out / rel).exists() or (out / rel).read_text() != text]
    built = {p.relative_to(out).as_posix() for p in out.rglob("*.html")}
    found += [f"{out / rel}: no longer part of the site" for rel in sorted(built - set(files))]
    return found


__all__ = ["LOOPS", "build", "render_site", "site_problems", "stale_files", "broken_links"]
