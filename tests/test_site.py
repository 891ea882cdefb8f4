"""The lessons as a static site (python -m manual_train.docs --html OUT, manual_train/site.py), opened in a real
browser: headless Chromium (Debian's `chromium`; .ci/run installs it) loads every page from file:// and reports its
console errors, every internal link and anchor is followed, the lessons' test and mutant links name tests and
mutants that exist, and the DDP lesson is photographed at a desktop and a phone width (SCREENSHOTS below).
Without Chromium the browser tests skip and say so; the staleness check and the hunk placement run anyway.
"""
from __future__ import annotations

import ast
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from chromium import Browser, chromium_binary
from mutants import catalogue

REPO = Path(__file__).resolve().parents[1]
SCREENSHOTS = REPO / "runs" / "site-screenshots"  # the DDP lesson at desktop and phone widths, for a person to look at
CHROMIUM = chromium_binary()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; "
                                    ".ci/run installs it)")
LESSON_LOOPS = {"data_parallel", "model_parallel", "hybrid", "ddp", "apex_o2", "pipeline", "zero", "tensor_parallel"}
TECHNIQUE_LOOP = {"dataparallel": "data_parallel", "model-parallel": "model_parallel", "hybrid": "hybrid",
                  "ddp": "ddp", "zero": "zero", "pipeline": "pipeline", "tensor-parallel": "tensor_parallel"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site, built once by the command a user runs."""
    out = tmp_path_factory.mktemp("site") / "site-out"
    proc = subprocess.run([sys.executable, "-m", "manual_train.docs", "--html", str(out)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr  # a broken link or a vanished test is printed as a warning
    return out


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed")
    b = Browser(CHROMIUM)
    yield b
    b.close()


def functions_in(file: str) -> set[str]:
    tree = ast.parse((REPO / file).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


# ---------------------------------------------------------------------- in the browser
@needs_chromium
def test_every_page_loads_without_console_errors_and_every_internal_link_resolves(built, browser):
    pages = sorted(built.rglob("*.html"))
    assert len(pages) >= 40, [p.name for p in pages]  # docs/*.md, 8 lessons, the tests page
    ids, links, errors = {}, [], []
    for page in pages:
        browser.navigate(page.as_uri())
        errors += [f"{page.relative_to(built)}: {e}" for e in browser.errors]
        # the stylesheet was applied (a missing one is a console error too, but say what it costs)
        assert browser.evaluate("getComputedStyle(document.querySelector('header.top')).display") == "flex", page
        ids[page] = set(browser.evaluate("[...document.querySelectorAll('[id]')].map(e => e.id)"))
        links += [(page, href) for href in browser.evaluate(
            "[...document.querySelectorAll('a[href], link[href], img[src]')].map(e => e.href || e.src)")]
    assert errors == []
    internal = [(page, href) for page, href in links if href.startswith("file://")]
    assert len(internal) > 1000, len(internal)  # every page's navigation alone links 12 pages
    broken = []
    for page, href in internal:
        parts = urlsplit(href)
        target = Path(unquote(parts.path))
        if not target.is_file():
            broken.append(f"{page.relative_to(built)} -> {href}: no such file")
        elif parts.fragment and unquote(parts.fragment) not in ids.get(target, set()):
            broken.append(f"{page.relative_to(built)} -> {href}: no such anchor")
    assert broken == []


@needs_chromium
def test_each_hunk_names_existing_tests_and_mutants_and_says_when_its_tests_are_the_whole_loops(built, browser):
    mutants = {m.name: m for m in catalogue()}
    placed = whole_only = 0
    for loop in sorted(LESSON_LOOPS):
        browser.navigate((built / "diffs" / f"{loop}.html").as_uri())
        hunks = browser.evaluate("document.querySelectorAll('section.hunk').length")
        assert hunks >= 5, (loop, hunks)
        tests = browser.evaluate("[...document.querySelectorAll('section.hunk a.test-link')].map(a => a.href)")
        shown = browser.evaluate("[...document.querySelectorAll('a.mutant-link')].map(a => a.href)")
        for href in tests:
            node = unquote(urlsplit(href).fragment)
            file, name = node.split("::")
            assert name in functions_in(file), f"{loop}: {node} is not a test"
        names = [unquote(urlsplit(href).fragment) for href in shown]
        assert set(names) <= set(mutants), f"{loop}: {set(names) - set(mutants)} are not in the catalogue"
        # every hunk names a test; one whose only tests are the whole loop's parity checks says so, and only that one
        # lists them; a test listed as the hunk's own kills a mutant of the hunk or of the code it calls
        per_hunk = browser.evaluate(
            "[...document.querySelectorAll('section.hunk')].map(s => ({id: s.id,"
            " tests: s.querySelectorAll('a.test-link').length, says_whole: !!s.querySelector('p.whole-loop'),"
            " whole: s.querySelectorAll('ul.whole-loop a.test-link').length,"
            " own: [...s.querySelectorAll('.proof > ul:not(.whole-loop) > li')].map(li => ({"
            "  test: li.querySelector('a.test-link').href, mutants: [...s.querySelectorAll("
            "  'a.mutant-link, a.mutant-ref')].filter(a => !a.closest('ul.whole-loop') && (li.contains(a)"
            "   || a.classList.contains('mutant-link'))).map(a => a.href)}))}))")
        assert [h["id"] for h in per_hunk if not h["tests"]] == [], f"{loop}: hunks without a test"
        for h in per_hunk:
            assert h["says_whole"] == (h["whole"] > 0) == (not h["own"]), (loop, h)
            whole_only += h["says_whole"]
            for li in h["own"]:
                node = unquote(urlsplit(li["test"]).fragment)
                named = [unquote(urlsplit(href).fragment) for href in li["mutants"]]  # #mutant-X on the page
                kills = {k.split("[")[0] for name in named for k in mutants[name.removeprefix("mutant-")].kill}
                assert node in kills, f"{loop} {h['id']}: {node} kills no mutant of this hunk or of the code it calls"
        # every mutant of this loop's file or of its technique is on its page, each once
        expected = {m.name for m in mutants.values()
                    if m.file == f"manual_train/loops/{loop}.py" or TECHNIQUE_LOOP.get(m.technique) == loop}
        assert sorted(names) == sorted(expected), loop
        # a hunk with a mutant names the test that kills it
        in_hunks = [unquote(urlsplit(href).fragment) for href in browser.evaluate(
            "[...document.querySelectorAll('section.hunk a.mutant-link')].map(a => a.href)")]
        placed += len(in_hunks)
        for name in in_hunks:
            assert mutants[name].file == f"manual_train/loops/{loop}.py", name
            kill = mutants[name].kill[0].split("[")[0]
            assert browser.evaluate(
                f"[...document.querySelectorAll('section.hunk')].some(s => s.querySelector("
                f"'a.mutant-link[href$=\"#{name}\"]') && s.textContent.includes({kill.split('::')[1]!r}))"), \
                f"{loop}: {name}'s hunk does not show {kill}"
    assert placed >= 10, placed  # the loops' own mutants (apex_o2, data_parallel, hybrid, ddp, ...) sit in hunks
    assert 0 < whole_only < 61, whole_only  # of the 61 hunks, those no mutant reaches: shown with the whole loop's tests


@needs_chromium
def test_the_ddp_lesson_reads_at_desktop_and_phone_widths(built, browser):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = (built / "diffs" / "ddp.html").as_uri()
    layout = ("(() => { const h = document.getElementById('hunk-2'); h.scrollIntoView();"
              " const r = e => h.querySelector(e).getBoundingClientRect();"
              " const vis = e => getComputedStyle(h.querySelector(e)).display !== 'none';"
              " return {note: r('.note').toJSON(), code: r('.code').toJSON(), side: vis('table.side'),"
              " unified: vis('table.unified'), scroll: document.documentElement.scrollWidth, width: innerWidth}; })()")
    for label, width, height, mobile in (("desktop", 1366, 900, False), ("phone", 390, 844, True)):
        browser.viewport(width, height, mobile)
        browser.navigate(page)
        assert browser.errors == []
        got = browser.evaluate(layout)
        assert got["scroll"] <= got["width"] + 1, (label, got)  # nothing pushes the page sideways
        if label == "desktop":  # the note beside the code, the diff side by side
            assert (got["side"], got["unified"]) == (True, False)
            assert got["note"]["right"] <= got["code"]["left"], got
        else:  # the note above the code, the diff unified
            assert (got["side"], got["unified"]) == (False, True)
            assert got["note"]["bottom"] <= got["code"]["top"], got
        png = browser.screenshot()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        (SCREENSHOTS / f"ddp-{label}.png").write_bytes(png)
    print(f"screenshots: {SCREENSHOTS}")
    # at the phone width (the last one set) no page is wider than the screen: code scrolls inside its own box
    for path in sorted(built.rglob("*.html")):
        browser.navigate(path.as_uri())
        wide = browser.evaluate("document.documentElement.scrollWidth - innerWidth")
        assert wide <= 1, f"{path.relative_to(built)} is {wide} px wider than a 390 px screen"


# ---------------------------------------------------------------------- without a browser
def test_a_built_site_is_checked_fresh_and_a_changed_one_is_stale(built):
    ok = subprocess.run([sys.executable, "-m", "manual_train.docs", "--check", "--html", str(built)], cwd=REPO,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    page = built / "diffs" / "ddp.html"
    original = page.read_text()
    try:
        page.write_text(original.replace("section class=\"hunk\"", "section class=\"old\"", 1))
        (built / "diffs" / "retired.html").write_text("<html></html>")
        stale = subprocess.run([sys.executable, "-m", "manual_train.docs", "--check", "--html", str(built)],
                               cwd=REPO, capture_output=True, text=True)
    finally:
        page.write_text(original)
        (built / "diffs" / "retired.html").unlink()
    assert stale.returncode == 1
    assert f"{page}: out of date" in stale.stdout
    assert f"{built / 'diffs' / 'retired.html'}: no longer part of the site" in stale.stdout


def test_a_changed_loop_makes_its_built_lesson_stale(built, tmp_path):
    """A marker comment edited in the code is on the rebuilt page and makes the old build stale (a copied tree)."""
    from manual_train import site

    root = tmp_path / "repo"
    for name in ("manual_train", "docs", "tests"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    loop = root / "manual_train" / "loops" / "ddp.py"
    text = loop.read_text()
    assert "# DDP: process_group picks the device" in text
    loop.write_text(text.replace("# DDP: process_group picks the device", "# DDP: the device comes from torchrun"))
    # the DDP lesson, and ZeRO's, whose base loop is DDP's
    assert site.stale_files(built, root) == [f"{built / 'diffs' / name}.html: out of date" for name in ("ddp", "zero")]
    assert "the device comes from torchrun" in site.render_site(root)["diffs/ddp.html"]


def test_a_folder_that_holds_no_site_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "manual_train.docs", "--html", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: --html: {tmp_path} is not empty and holds no site (allowed: "
                                                f"a new folder or one that holds a site)"]
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_broken_links_and_anchors_are_named():
    from manual_train.site import broken_links

    files = {"index.html": '<a href="a.html#x">a</a><a href="a.html#nope">a</a><a href="gone.html">g</a>'
                           '<a href="https://example.org/">web</a><img src="img/p.png">',
             "a.html": '<h2 id="x">x</h2><a href="#x">self</a><a href="#y">self</a>'}
    assert broken_links(files, {"img/p.png"}) == [
        "index.html: link to a.html#nope: no such anchor", "index.html: link to gone.html: no such page",
        "a.html: link to #y: no such anchor"]


def test_each_mutant_of_a_loop_sits_under_the_hunk_that_holds_its_code(built):
    html = (built / "diffs" / "ddp.html").read_text()
    sections = re.split(r'<section class="hunk" id="hunk-\d+">', html)[1:]
    holding = [s for s in sections if "sampler.set_epoch" in s]
    assert holding and any('id="mutant-ddp-no-set-epoch"' in s for s in holding)
    assert sum('id="mutant-ddp-no-set-epoch"' in s for s in sections) == 1
    # ... its kill test with what it compares, and the distance the kill matrix measured
    entry = next(s for s in holding if 'id="mutant-ddp-no-set-epoch"' in s)
    assert "tests/test_ddp_parity.py::test_uneven_windows_on_two_ranks_equal_one_process" in entry
    matrix = (REPO / "docs" / "mutants.md").read_text()
    distance = re.search(r"`ddp-no-set-epoch` \|[^|]*\|[^|]*\| ([^|]+) \|", matrix).group(1).strip()
    assert f"kill distance {distance}" in entry


def test_a_hunk_that_calls_library_code_shows_the_tests_of_its_mutants_and_the_others_the_parity_checks(built):
    """ZeRO's loop has no mutant of its own: the hunk that calls zero.shard() shows the tests that kill the mutants of
    manual_train/zero.py that shard() runs; the other hunks show the parity checks as the whole loop's, each distance
    the one measured under a mutant, against the bound the test asserts."""
    html = (built / "diffs" / "zero.html").read_text()
    sections = re.split(r'<section class="hunk" id="hunk-\d+">', html)[1:]
    calling = [s for s in sections if re.search(r"\bshard</span><span class=\"p\">\(", s)]
    assert calling and all("<code>shard()</code>" in s and 'class="none whole-loop"' not in s for s in calling)
    for s in calling:
        assert "tests/test_zero_cli.py::test_shards_optimizer_steps_the_parameters_forward_uses" in s
        assert 'href="#mutant-zero-fsdp2-optimizer-before-sharding"' in s
    others = [s for s in sections if s not in calling]
    assert others and all('class="none whole-loop"' in s for s in others)
    matrix = (REPO / "docs" / "mutants.md").read_text()
    distance = re.search(r"`zero-oss-clip-local-norm` \|[^|]*\|[^|]*\| ([^|]+) \|", matrix).group(1).strip()
    for s in others:
        assert "tests/test_zero_parity.py::test_every_cpu_capable_impl_and_stage_equals_ddp" in s
        assert f"zero-oss-clip-local-norm</code></a>: max abs diff {distance}, bound 1e-9 (64-true)" in s


# Each hunk's docs note, judged by reading the hunk and docs/<technique>.md (2026-12-05): the hunk, named by code on
# its changed lines -> the section and the first words of the paragraph that explains it, or None where no paragraph
# of the page does (no note is better than a wrong one). The notes come from the docs' `<!-- explains: ... -->`
# comments (manual_train/site.py); the word-overlap guess they replaced gave the pick after `was:` instead.
DOC_NOTES = [
    # wrong before
    ("ddp", "with process_group(cfg) as", "What the diff changes (tag DDP)", "Set-up. Rank"),  # was: Exact evaluation
    ("pipeline", "raw_model = Pipeline(raw_model", "What the diff changes (tag PIPELINE)", "The split."),  # was: Resume
    ("pipeline", "reduce_tied_grads()", "What the diff changes (tag PIPELINE)", "Tied weights"),  # was: Parity
    ("data_parallel", "peak_mem_per_device(devices + [device])", None, None),  # was: Which test proves what
    ("hybrid", "the targets go where the logits come out", None, None),  # was: Which test proves what
    ("hybrid", "**summary_extra(cfg", None, None),  # was: --mode dp-mp, "Three things are wrong there"
    ("apex_o2", "optimizer.zero_grad()  # APEX_O2", None, None),  # was: O1 vs O2, "O1 patched torch functions"
    ("apex_o2", "the docstring shows", "apex's O2, written out (and apex itself)",
     "Code: launch/apex_o2.py"),  # was: 1. Set-up
    ("zero", "def train(cfg: ZeroConfig)", "ZeRO: sharding the optimizer state, the gradients and the parameters over "
     "the ranks", "Code: manual_train/loops/zero.py"),  # was: Parity: the same model as DDP
    ("zero", "def train_rank(cfg: ZeroConfig", "ZeRO: sharding the optimizer state, the gradients and the parameters "
     "over the ranks", "Code: manual_train/loops/zero.py"),  # was: no note
    ("zero", "sharded.grad_scaler(", "ZeRO: sharding the optimizer state, the gradients and the parameters over the "
     "ranks", "The GradScaler."),  # was: the Checkpoints item
    ("zero", "sharded.no_sync(window_end)", "What each stage shards", "ZeRO trades communication for memory"),
    ("zero", "sharded.clip_grad_norm(", "Traps", "Clipping: with sharded"),  # was: consolidate_state_dict
    ("tensor_parallel", "def train_rank(cfg: TensorParallelConfig", "Tensor parallelism and 2-D FSDP2 × TP: "
     "launch/tensor_parallel.py", "Every transformer block"),  # was: no note
    ("tensor_parallel", "replicas=dp)", "What the diff changes (tag TENSOR_PARALLEL)", "The replicas."),  # was: resume
    ("tensor_parallel", "weight = targets * dp", "What the diff changes (tag TENSOR_PARALLEL)", "The replicas."),
    ("tensor_parallel", "parallelize(sync_batchnorm(", "What the diff changes (tag TENSOR_PARALLEL)", "The model."),
    # a better one than before
    ("data_parallel", "ExplicitDataParallel(model, devices, device)", "DataParallel: one process, the batch split over "
     "devices", "Code: manual_train/loops/data_parallel.py"),  # was: "On CUDA these are"
    ("model_parallel", "mp_plan(", "Micro-batches: GPipe's fill-drain schedule", "(M = 1 is naive"),  # was: the intro
    ("hybrid", "ddp_kwargs(device=None)", "--mode ddp-mp: the modern form, one process per device pair",
     "Each process splits the model"),  # the section its marker cites (was: "One loop for both modes")
    ("pipeline", "with process_group(cfg) as", "Why its parent is the baseline, not the DDP loop",
     "Every stage needs the same batch"),  # was: the Defaults paragraph, measured results
    ("zero", "sharded.memory_report()", "ZeRO: sharding the optimizer state, the gradients and the parameters over "
     "the ranks", "The end."),  # was: What is measured
    # right before, and still
    ("ddp", "DDP(sync_batchnorm(model", "What the diff changes (tag DDP)", "The model. DistributedDataParallel"),
    ("ddp", "evaluate(model.module", "Exact evaluation", "Evaluation calls the wrapped module"),
    ("ddp", "else model.no_sync():", "Accumulation: no_sync()", "With --accumulate K"),
    ("data_parallel", "# >>> DATA_PARALLEL: one loss over the gathered batch", "What runs where (one optimizer step, 2 "
     "GPUs, batch 32)", "One loss over the gathered outputs."),
    ("model_parallel", "split_encoder_decoder(raw_model,", "What runs where", "split_encoder_decoder(raw_model"),
    ("hybrid", "evaluate(model.module", "Hybrid data + model parallelism", "One loop for both modes."),
    ("apex_o2", "(loss * scaler.scale).backward()", "The hand-written O2, step by step (manual_train/loops/apex_o2.py)",
     "Backward: (loss * scaler.scale)"),
    ("pipeline", "raw_model.wrap_optimizer(", "What the diff changes (tag PIPELINE)", "Checkpoints. Pipeline"),
    ("zero", "sharded.zero_grad()", "Traps", "The zero_grad trap"),
    ("tensor_parallel", "dp_coords(cfg, env)", "What the diff changes (tag TENSOR_PARALLEL)", "The replicas."),
]


def hunk_notes(built: Path, loop: str) -> list[tuple[str, str | None, str]]:
    """(the hunk's changed lines on the new side, the docs note's section or None, the note's text) of a lesson."""
    def text(fragment: str) -> str:
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())

    out = []
    for s in re.split(r'<section class="hunk" id="hunk-\d+">', (built / "diffs" / f"{loop}.html").read_text())[1:]:
        plus = "\n".join(html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(
            r'<td class="right plus">(.*?)</td>', s))
        note = re.search(r'<div class="docnote"><p class="from">From <a href="[^"]*">[^<]*, “([^”]*)”</a>:</p>'
                         r'(.*?)</div>', s, re.S)
        out.append((plus, html.unescape(note.group(1)) if note else None, text(note.group(2)) if note else ""))
    return out


def test_each_hunk_shows_the_docs_paragraph_that_explains_it_or_none(built):
    """The notes judged right (DOC_NOTES), among them the ones the word-overlap guess got wrong: a hunk of DDP's set-up
    beside "Exact evaluation", pipeline's split beside "Resume", a hunk beside "Which test proves what"."""
    wrong = []
    for loop, code, heading, starts in DOC_NOTES:
        hunks = [h for h in hunk_notes(built, loop) if code in h[0]]
        assert len(hunks) == 1, f"{loop}: {len(hunks)} hunks change a line with {code!r}"
        _, got, note = hunks[0]
        got = got and got.replace("`", "")  # the page shows the heading's `code` marks
        if got != heading or not note.startswith(starts or ""):
            wrong.append(f"{loop}, the hunk writing {code!r}: {got!r}, {note[:50]!r}; right: {heading!r}, "
                         f"{starts!r}")
    assert wrong == [], "\n".join(wrong)
    # the hunks no paragraph explains show no docs note at all: the four above
    assert sum(h[1] is None for loop in LESSON_LOOPS for h in hunk_notes(built, loop)) == 4


def test_an_explains_comment_that_names_no_changed_line_is_reported(tmp_path):
    """`--check` (site_problems) names an `explains:` string no hunk of its lesson writes: a typo or code since
    renamed would otherwise leave its hunk without a note, silently."""
    from manual_train import site
    from manual_train.docs import LOOPS

    ddp = next(loop for loop in LOOPS if loop.name == "ddp")
    (tmp_path / "manual_train" / "loops").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in ("single", "ddp"):
        shutil.copy(REPO / "manual_train" / "loops" / f"{name}.py", tmp_path / "manual_train" / "loops")
    page = (REPO / "docs" / "ddp.md").read_text()
    (tmp_path / "docs" / "ddp.md").write_text(page)
    assert site.stale_explains(ddp, tmp_path) == []
    (tmp_path / "docs" / "ddp.md").write_text(page.replace("<!-- explains: DDP(sync_batchnorm( -->",
                                                           "<!-- explains: DDP(sync_batchnorm(, DDP(model -->"))
    assert site.stale_explains(ddp, tmp_path) == [
        'docs/ddp.md: <!-- explains: DDP(model --> ("What the diff changes (tag DDP)"): no hunk of the ddp lesson '
        'changes a line with it']
