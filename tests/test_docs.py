"""Docs that cannot rot: loop diff pages up to date, every loop change marked, and every path, name,
test and command the README and docs/ mention exists and runs (--help) with the flags they show; every training
command they and the --help texts show parses and passes validate(), and every resume they show is one the resume
rules accept."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
from conftest import REPO

from manual_train import docs

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # docs/diffs/ is generated from code
LAUNCH_SCRIPTS = sorted(p.stem for p in (REPO / "launch").glob("*.py"))
MODULES = ["manual_train.bench", "manual_train.find_batch_size", "manual_train.docs", "manual_train.evaluate",
           "manual_train.checkpoint", "manual_train.generate", "manual_train.parity", "manual_train.tune"]


# ---------------------------------------------------------------------- teach by diff
@pytest.mark.parametrize("loop", docs.existing_loops(), ids=lambda loop: loop.name)
def test_every_loop_change_is_marked(loop):
    """Fails when a loop changes a line outside a marked block, or when its base loop changed and the
    change was not ported (the base's new lines then show up as unmarked differences)."""
    bad = docs.unmarked_differences(docs.loop_lines(loop.base), docs.loop_lines(loop.name), loop.tag)
    assert bad == [], f"{loop.name}.py vs {loop.base}.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("loop", docs.existing_loops(), ids=lambda loop: loop.name)
def test_diff_page_is_up_to_date(loop):
    page = docs.page_path(loop)
    assert page.exists() and page.read_text() == docs.render(loop), \
        f"{page.relative_to(REPO)} is stale: run python -m manual_train.docs"


def test_the_checks_catch_an_unmarked_edit_and_a_stale_page(tmp_path):
    (tmp_path / "manual_train" / "loops").mkdir(parents=True)
    (tmp_path / "docs" / "diffs").mkdir(parents=True)
    for name in ("single", "ddp"):
        shutil.copy(REPO / "manual_train" / "loops" / f"{name}.py", tmp_path / "manual_train" / "loops")
    shutil.copy(REPO / "docs" / "diffs" / "ddp.md", tmp_path / "docs" / "diffs")
    assert docs.problems(tmp_path) == []
    path = tmp_path / "manual_train" / "loops" / "ddp.py"
    text = path.read_text()
    path.write_text(text.replace("    model.train()\n", "    model.train()\n    torch.set_num_threads(1)\n", 1))
    found = docs.problems(tmp_path)
    assert any("out of date" in f for f in found)
    assert any("unmarked line" in f and "torch.set_num_threads(1)" in f for f in found)


def test_the_checks_catch_a_long_comment_block_in_a_hunk_and_a_long_docstring(tmp_path):
    """--check fails on a comment block of more than 3 lines inside a marked hunk and on a loop docstring of more than
    15 lines (the long why belongs on the technique's docs page); the tree passes both."""
    loops = tmp_path / "manual_train" / "loops"
    loops.mkdir(parents=True)
    (tmp_path / "docs" / "diffs").mkdir(parents=True)
    for name in ("single", "ddp"):
        shutil.copy(REPO / "manual_train" / "loops" / f"{name}.py", loops)
    shutil.copy(REPO / "docs" / "diffs" / "ddp.md", tmp_path / "docs" / "diffs")
    assert docs.problems(tmp_path) == []
    ddp = loops / "ddp.py"
    text = ddp.read_text()
    hunk = "    seed_everything(cfg.seed + env.rank)"
    assert text.count(hunk) == 1
    ddp.write_text(text.replace(hunk, "    # one\n    # two\n    # three\n    # four: a fourth comment line\n" + hunk))
    found = docs.problems(tmp_path)
    assert any("comment block of 4 lines in a marked hunk" in f for f in found), found
    assert not any("docstring" in f for f in found)
    ddp.write_text(text.replace('"""Distributed', '"""Distributed\n' + "\n" * 5, 1))
    found = docs.problems(tmp_path)
    assert any("ddp.py: its docstring is" in f for f in found), found
    assert not any("comment block" in f for f in found)
    # the same four comment lines outside any marked hunk are the baseline's business, not the check's
    assert docs.long_hunk_comments(["# a", "# b", "# c", "# d", "x = 1"], "DDP") == []
    assert docs.long_hunk_comments(["# >>> DDP: a", "# b", "# c", "x = 1", "# <<< DDP"], "DDP") == []


def test_the_tree_has_no_long_hunk_comments_or_loop_docstrings():
    long = [f for f in docs.problems() if "comment block" in f or "docstring" in f]
    assert long == [], "\n".join(long)


# ---------------------------------------------------------------------- the lesson budget
def test_stats_count_code_lines_and_the_marked_share(tmp_path):
    """--stats on a hand-made pair: docstrings, comments and blank lines are not code; marked lines count as the
    technique's, an unmarked added line does not; a removed base line counts as removed."""
    loops = tmp_path / "manual_train" / "loops"
    loops.mkdir(parents=True)
    (loops / "single.py").write_text('def train(cfg):\n    """Doc\n    string."""\n    x = 1\n    y = 2\n'
                                     '    return x + y\n')
    (loops / "ddp.py").write_text('def train(cfg):\n    """Doc\n    string."""\n    x = 1\n'
                                  '    # >>> DDP: why\n    # more why\n    z = 3\n\n    w = 4\n    # <<< DDP\n'
                                  '    v = 5\n    return x + y\n')
    assert docs.code_line_numbers((loops / "single.py").read_text()) == {1, 4, 5, 6}
    ddp = next(loop for loop in docs.LOOPS if loop.name == "ddp")
    st = docs.diff_stats(ddp, tmp_path)
    # added: z, w (marked) and v (unmarked); removed: y = 2
    assert (st["added"], st["removed"], st["changed"]) == (3, 1, 4)
    assert st["tagged_share"] == pytest.approx(2 / 3)


def test_every_lesson_is_within_its_budget():
    """python -m manual_train.docs --stats: each parallel loop <= 90 changed code lines against its parent, >= 80%
    of its added lines marked with its tag, no loop file over 300 lines, the baseline's train() <= 120 code lines,
    no other function over 60."""
    assert docs.over_budget() == []


def test_one_name_per_technique():
    """A technique has one name: its loop, its launch script, its SCRIPT (run folder prefix, summary.json's
    `script`), its docs page and its marker tag (the name in capitals); launch/ and loops/ hold the same names."""
    import importlib

    names = {loop.name for loop in docs.LOOPS} | {"single"}
    assert {p.stem for p in (REPO / "launch").glob("*.py")} == names
    assert {p.stem for p in (REPO / "manual_train" / "loops").glob("*.py")} - {"__init__"} == names
    for name in sorted(names):
        module = importlib.import_module(f"manual_train.loops.{name}")
        assert module.SCRIPT == name, f"loops/{name}.py: SCRIPT = {module.SCRIPT!r}"
        launch = (REPO / "launch" / f"{name}.py").read_text()
        assert f"from manual_train.loops import {name}" in launch and f'script="{name}"' in launch, name
    for loop in docs.LOOPS:
        assert (REPO / "docs" / f"{loop.name}.md").is_file(), f"docs/{loop.name}.md"
        assert loop.tag == loop.name.upper() and f"# >>> {loop.tag}:" in "\n".join(docs.loop_lines(loop.name))


# ---------------------------------------------------------------------- --help of every entry point
def run_help(target: str) -> str:
    """Execute a launch script (or `python -m` module) in-process with --help; return what it printed."""
    out = io.StringIO()
    argv = sys.argv
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            if target.startswith("manual_train."):
                sys.argv = [target, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [f"{target}.py", "--help"]
                runpy.run_path(str(REPO / "launch" / f"{target}.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert exit_info.value.code in (0, None), out.getvalue()
    return out.getvalue()


@lru_cache(maxsize=None)
def flags_of(target: str) -> frozenset:
    return frozenset(re.findall(r"--[a-z0-9][a-z0-9-]*", run_help(target)))


@pytest.mark.parametrize("target", LAUNCH_SCRIPTS + MODULES)
def test_help_runs_and_explains(target):
    text = run_help(target)
    assert text.startswith("usage:") and "--help" in text
    assert len(flags_of(target)) >= 2


# ---------------------------------------------------------------------- no rot in README and docs
PATH_RE = re.compile(r"(?<![\w./-])((?:manual_train|launch|tests|docs|scripts)/[\w/.\-]*[\w/])")
TEST_RE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
SPAN_RE = re.compile(r"`([^`\n]+)`")
COMMAND_RE = re.compile(r"(?:python3?|torchrun)\b[^`\n|]*?(?:launch/(\w+)\.py|-m (manual_train\.\w+))([^`\n|#]*)")


def mentions():
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            yield page.name if page.parent != REPO / "docs" else f"docs/{page.name}", number, line


def test_every_mentioned_path_exists():
    missing = []
    for page, number, line in mentions():
        for path in PATH_RE.findall(line):
            path = path.split("::")[0]
            if "<" in path or "*" in path or path.endswith(".pt"):
                continue
            if not (REPO / path).exists():
                missing.append(f"{page}:{number}: {path}")
    assert not missing, "\n".join(missing)


def test_every_mentioned_test_exists():
    missing = []
    for page, number, line in mentions():
        for path, name in TEST_RE.findall(line):
            file = REPO / path
            if not file.exists() or not re.search(rf"^def {name}\(", file.read_text(), re.M):
                missing.append(f"{page}:{number}: {path}::{name}")
    assert not missing, "\n".join(missing)


def test_names_mentioned_beside_a_file_exist_in_it():
    """`manual_train/x.py`, `name` (or `Class.method`, or `name(...)`) on one line: the name must occur
    in that file. Renaming a function without updating its docs fails here."""
    missing = []
    for page, number, line in mentions():
        for segment in re.split(r"\||(?<=[.;])\s", line):  # a table cell or a sentence
            missing += [f"{page}:{number}: {name}" for name in names_missing_beside_files(segment)]
    assert not missing, "\n".join(missing)


def names_missing_beside_files(segment: str) -> list:
    missing, current = [], None
    for span in SPAN_RE.findall(segment):
        span = span.strip()
        if re.fullmatch(r"manual_train/[\w/]+\.py", span):
            current = (REPO / span).read_text() if (REPO / span).exists() else None
            continue
        if current is None:
            continue
        name = re.match(r"([A-Za-z_][\w.]*)(\(.*\))?$", span)
        if not name or span.startswith("--") or name.group(1) in ("True", "False", "None"):
            continue
        parts = name.group(1).split(".")
        if not all(re.search(rf"\b{re.escape(p)}\b", current) for p in parts):
            missing.append(name.group(1))
    return missing


def help_mentions():
    """(where, line number, line) of every --help text (a loop's docstring is its script's) and launch/*.py docstring:
    the commands a user copies from `--help` rot like the docs' do."""
    for target in LAUNCH_SCRIPTS + MODULES:
        for number, line in enumerate(run_help(target).splitlines(), 1):
            yield f"{target} --help", number, line
    for script in LAUNCH_SCRIPTS:
        doc = ast.get_docstring(ast.parse((REPO / "launch" / f"{script}.py").read_text())) or ""
        for number, line in enumerate(doc.splitlines(), 1):
            yield f"launch/{script}.py docstring", number, line


def test_every_command_in_the_docs_takes_the_flags_it_shows():
    bad = []
    for page, number, line in [*mentions(), *help_mentions()]:
        for script, module, rest in COMMAND_RE.findall(line):
            target = script or module
            if script and not (REPO / "launch" / f"{script}.py").exists():
                bad.append(f"{page}:{number}: no launch/{script}.py")
                continue
            if module and module not in MODULES:
                bad.append(f"{page}:{number}: unknown module {module}")
                continue
            for flag in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", rest):
                if flag not in flags_of(target):
                    bad.append(f"{page}:{number}: {target} has no {flag}")
    assert not bad, "\n".join(bad)


# Pages whose ```python blocks quote the code as it is (comments and `...` aside); other pages' blocks sketch it
# (zero.md), quote the articles (errata.md) or Lightning (parity.md).
QUOTING_PAGES = ("accumulation.md", "ddp_knobs.md", "early_stopping.md", "logging.md", "loop_overhead.md",
                 "model_parallel.md", "precision.md")


def unquoted_lines(page: Path, source: str) -> list:
    """The lines of the page's ```python blocks that are not in `source` (whitespace-normalised)."""
    def squash(text: str) -> str:
        return re.sub(r"\s+", " ", text).strip()

    source, missing, block = squash(source), [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            block = [] if line.strip() == "```python" and block is None else None
            continue
        code = re.split(r"\s#\s", line.strip(), maxsplit=1)[0].strip()
        if block is not None and code and not code.startswith(("#", "...")) and squash(code) not in source:
            missing.append(f"docs/{page.name}:{number}: {code}")
    return missing


def test_code_the_docs_quote_is_the_code():
    """A snippet that quotes the loop or the run (docs/early_stopping.md's run.log_val and run.save lines) must
    still be in manual_train/: renaming or reshaping a line without its page fails here."""
    source = "\n".join(p.read_text() for p in sorted((REPO / "manual_train").rglob("*.py")))
    missing = [line for name in QUOTING_PAGES for line in unquoted_lines(REPO / "docs" / name, source)]
    assert not missing, "\n".join(missing)


def test_the_code_line_counts_the_docs_cite_are_the_stats():
    """docs/index.md's count of the baseline train()'s code lines, and a loop page's "the diff is N code lines",
    are what `python -m manual_train.docs --stats` counts now."""
    index = (REPO / "docs" / "index.md").read_text()
    assert f"(function `train`: {docs.baseline_train_code_lines()} code lines," in index
    for loop in docs.LOOPS:
        for cited in re.findall(r"the diff is (\d+) code lines", (REPO / "docs" / f"{loop.name}.md").read_text()):
            assert int(cited) == docs.diff_stats(loop)["changed"], (loop.name, cited)


def test_the_rot_checks_can_fail(monkeypatch, tmp_path):
    page = tmp_path / "rotten.md"
    page.write_text("See `manual_train/data.py`, `build_loader_v2`, and tests/test_data.py::test_gone;\n"
                    "run `python launch/single.py --no-such-flag` or manual_train/nowhere.py.\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(sys.modules[__name__], "REPO", REPO)
    for check in (test_every_mentioned_path_exists, test_every_mentioned_test_exists,
                  test_names_mentioned_beside_a_file_exist_in_it,
                  test_every_command_in_the_docs_takes_the_flags_it_shows):
        with pytest.raises(AssertionError):
            check()
    page.write_text("```python\nrun.save(epoch, step)  # a quote\n...\n"
                    "model = split_encoder_decoder(raw_model, devices, cfg.microbatches)\n```\n")
    assert unquoted_lines(page, (REPO / "manual_train" / "loops" / "model_parallel.py").read_text()) == [
        "docs/rotten.md:2: run.save(epoch, step)"]


# ---------------------------------------------------------------------- every training command shown is one that works
class Shown(NamedTuple):
    """A `python`/`torchrun` command a reader may copy, as shown (placeholders such as runs/<run> kept)."""
    where: str
    group: str  # a page, a --help text or a docstring: a --resume refers to an --out-dir written earlier in it
    target: str  # a launch script's name, or a manual_train module
    nproc: int  # torchrun's --nproc_per_node, 1 for python
    torchrun: bool
    argv: list
    env: dict  # VAR=value before the command
    refused: bool  # a table row's input whose outcome (the next cell) is an error: it must be refused


PLACEHOLDER_NPROC = re.compile(r"^[A-Z][A-Z*]*$")  # --nproc_per_node=N, P, D*T: a template, not a command


def parse_shown(text: str, where: str, group: str, refused: bool = False) -> Optional[Shown]:
    """The command in one code line or inline span, or None for anything else (a make target, a template with N
    processes or `...` for flags, a prompt that is not ours)."""
    try:
        tokens = shlex.split(text.replace("\\|", "|"), comments=True)
    except ValueError:
        return None
    env = {}
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # OMP_NUM_THREADS=1 python ...
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    if not tokens or Path(tokens[0]).name not in ("python", "python3", "torchrun") or "..." in tokens:
        return None
    torchrun, nproc = Path(tokens[0]).name == "torchrun", 1
    for i, token in enumerate(tokens[1:], 1):
        if token == "-m" and i + 1 < len(tokens):
            target, argv = tokens[i + 1], tokens[i + 2:]
            if not target.startswith("manual_train."):
                return None
            break
        script = re.fullmatch(r"(?:.*/)?launch/(\w+)\.py", token)
        if script:
            target, argv = script.group(1), tokens[i + 1:]
            break
        if not torchrun:
            return None
        value = re.fullmatch(r"--nproc[_-]per[_-]node(?:=(.+))?", token)
        if value:
            count = value.group(1) or tokens[i + 1]
            if PLACEHOLDER_NPROC.match(count):
                return None
            nproc = int(count)
    else:
        return None
    optional = re.sub(r"\[[^\]]*\]", " ", shlex.join(argv))  # [--split val|test]: optional, left out
    return Shown(where, group, target, nproc, torchrun, shlex.split(optional), env, refused)


def code_texts(page: Path):
    """(line number, text, refused) of what a page shows as code: fenced and indented code lines, and inline spans.
    refused: a span in a table row's first cell whose next cell says `error` (docs/what-happens-when.md's rows:
    what you type | what happens)."""
    fence = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if (fence or line.startswith("    ")) and "`" not in line:
            yield number, line.strip(), False
            continue
        cells = line.split(" | ") if line.startswith("| ") else [line]
        for i, cell in enumerate(cells):
            refused = i == 0 and len(cells) > 1 and re.search(r"\berror\b", cells[1]) is not None
            for span in SPAN_RE.findall(cell):
                yield number, span, refused


def text_lines(text: str):
    return ((number, line, False) for number, line in enumerate(text.splitlines(), 1))


def shown_commands() -> list:
    """Every command shown in README.md, docs/*.md, the --help texts and the launch scripts' docstrings, in the
    order a reader meets them, with the commands nested in `python -m manual_train.parity --a "..." --b "..."`."""
    found = []
    sources = [(page.name if page.parent != REPO / "docs" else f"docs/{page.name}", code_texts(page))
               for page in PAGES]
    sources += [(f"{target} --help", text_lines(run_help(target))) for target in LAUNCH_SCRIPTS]
    sources += [(f"launch/{s}.py docstring", text_lines(ast.get_docstring(ast.parse(
        (REPO / "launch" / f"{s}.py").read_text())) or "")) for s in LAUNCH_SCRIPTS]
    for group, texts in sources:
        for number, text, refused in texts:
            shown = parse_shown(text.strip(), f"{group}:{number}", group, refused)
            if shown is None:
                continue
            found.append(shown)
            if shown.target == "manual_train.parity":
                for flag in ("--a", "--b"):
                    if flag in shown.argv[:-1]:
                        inner = shown.argv[shown.argv.index(flag) + 1]
                        inner = inner if inner.split()[0] in ("python", "torchrun") else f"python {inner}"
                        nested = parse_shown(inner, f"{group}:{number} ({flag})", group, refused)
                        found += [nested] if nested else []
    return found


@lru_cache(maxsize=None)
def launch_entry(script: str) -> tuple:
    """(config class, per-script defaults) that launch/<script>.py hands to cli.run, read by running the script with
    cli.run replaced: the script's own choice, not a copy of it here."""
    import manual_train.cli as cli

    seen = {}

    def capture(train, config_cls=None, *, script, doc=None, argv=None, **defaults):
        from manual_train.config import Config
        seen.update(config_cls=config_cls or Config, defaults=defaults)
        return 0

    original, cli.run = cli.run, capture
    try:
        with pytest.raises(SystemExit):
            runpy.run_path(str(REPO / "launch" / f"{script}.py"), run_name="__main__")
    finally:
        cli.run = original
    return seen["config_cls"], seen["defaults"]


@contextlib.contextmanager
def as_launched(shown: Shown, folder: Path, monkeypatch):
    """The process the command would start, as validate() sees it: torchrun's environment for rank 0 of
    --nproc_per_node ranks (or none), the command's relative paths under `folder` (a --resume file made empty:
    validate only checks that it exists), and, where the command names a GPU or apex, 8 CUDA devices and an
    importable apex.amp: what the machine has is its business, the flags are the docs'."""
    import types

    import torch

    with monkeypatch.context() as patch:
        patch.chdir(folder)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            patch.delenv(name, raising=False)
        for name, value in shown.env.items():  # WORLD_SIZE=2 python launch/ddp.py
            patch.setenv(name, value)
        if shown.torchrun:
            patch.setenv("RANK", "0")
            patch.setenv("LOCAL_RANK", "0")
            patch.setenv("WORLD_SIZE", str(shown.nproc))
            patch.setenv("LOCAL_WORLD_SIZE", str(shown.nproc))
            patch.setenv("MASTER_ADDR", "127.0.0.1")
            patch.setenv("MASTER_PORT", "29500")
        if "cuda" in " ".join(shown.argv) or "apex-o2" in shown.argv:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "device_count", lambda: 8)
            patch.setattr(torch.cuda, "current_device", lambda: 0)
            patch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        if "apex-o2" in shown.argv:
            apex = types.ModuleType("apex")
            apex.amp = types.ModuleType("apex.amp")
            patch.setitem(sys.modules, "apex", apex)
            patch.setitem(sys.modules, "apex.amp", apex.amp)
        if "--resume" in shown.argv[:-1]:
            resume = shown.argv[shown.argv.index("--resume") + 1]
            if resume != "auto":
                (folder / resume).parent.mkdir(parents=True, exist_ok=True)
                (folder / resume).touch()
        yield


def parsed(shown: Shown, folder: Path, monkeypatch):
    """The validated config the command's script would train with (parse_config: argparse, bounds, validate())."""
    from manual_train.config import parse_config

    config_cls, defaults = launch_entry(shown.target)
    folder.mkdir(parents=True, exist_ok=True)
    with as_launched(shown, folder, monkeypatch), contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return parse_config(config_cls, shown.argv, prog=f"{shown.target}.py", quiet=True, **defaults)
        except SystemExit:  # argparse's own refusal (an unknown flag, a bad choice)
            raise AssertionError(err.getvalue().strip()) from None


def replicas(shown: Shown, cfg) -> int:
    """Data-parallel replicas of the run (the checkpoint's world_size): one per rank for DDP, ZeRO and hybrid
    ddp-mp; --dp for tensor parallelism; one for the pipeline (its stages share every batch) and every one-process
    script."""
    if shown.target == "tensor_parallel":
        return cfg.dp
    return 1 if shown.target == "pipeline" else shown.nproc


def planned_steps(shown: Shown, cfg) -> tuple[int, int]:
    """(optimizer steps per epoch, the run's total), as the loops compute them: micro-batches of batch x replicas
    over the epoch's samples, one step per window of --accumulate."""
    from manual_train import data

    with contextlib.redirect_stdout(io.StringIO()):
        train_ds, _, _ = data.build_datasets(cfg)
    micro_batch = cfg.batch_size * replicas(shown, cfg)
    per_epoch = data.steps_per_epoch(data.limit_train(len(train_ds), cfg, micro_batch), micro_batch, cfg.accumulate)
    return per_epoch, cfg.max_steps or cfg.epochs * per_epoch


def resume_refusal(writer: Shown, written, reader: Shown, resumed, finished: bool) -> Optional[str]:
    """What checkpoint.check_compatible says to `reader` resuming the checkpoint `writer` leaves (at its end when
    finished, else after its first epoch, as a run stopped there would): None when it continues training."""
    from manual_train.checkpoint import RunFinished, check_compatible
    from manual_train.config import UsageError

    per_epoch, total = planned_steps(writer, written)
    step = total if finished else min(per_epoch, total - 1)
    ckpt = {"config": dataclasses.asdict(written), "world_size": replicas(writer, written), "step": step,
            "early_stopping": {"should_stop": False}, "script": writer.target,
            "progress": {"epoch_samples_done": 0, "micro_steps_done": 0}}
    global_batch = resumed.batch_size * resumed.accumulate * replicas(reader, resumed)
    try:
        check_compatible(ckpt, resumed, global_batch, planned_steps(reader, resumed)[1], script=reader.target)
    except (UsageError, RunFinished) as e:
        return str(e)
    return None


RUN_FOLDER_RE = re.compile(r"runs/(\w+)-<time>$")  # the run folder of a script, its time left out
PLACEHOLDER_DIR_RE = re.compile(r"[A-Z]{3,}|.*<\w+>.*")  # RUN, runs/<run>: the folder of a run shown earlier


def resume_source(shown: Shown, cfg, earlier: list, tmp: Path, monkeypatch) -> tuple:
    """(the command that wrote the checkpoint, its config, whether that run had finished) for a --resume, from the
    commands shown before it in its group: the latest that wrote that --out-dir (it finished); for a placeholder
    folder (runs/<script>-<time>, RUN) the latest that wrote to its default folder (of that script), stopped
    before its end, or else this command's own flags, stopped ("the run's own flags: continues where it
    stopped"). (None, why, None) when the page shows no such run."""
    folder = str(Path(cfg.resume).parent)
    mine = [(writer, wcfg) for writer, wcfg in reversed(earlier) if writer.group == shown.group]
    for writer, wcfg in mine:
        if wcfg.out_dir == folder:
            return writer, wcfg, True
    named = RUN_FOLDER_RE.fullmatch(folder)
    if not (named or PLACEHOLDER_DIR_RE.fullmatch(folder)):
        return None, f"no command on this page writes --out-dir {folder}", None
    script = named.group(1) if named else shown.target
    for writer, wcfg in mine:
        if wcfg.out_dir is None and writer.target == script:
            return writer, wcfg, False
    own = [a for i, a in enumerate(shown.argv) if a != "--resume" and not (i and shown.argv[i - 1] == "--resume")]
    writer = shown._replace(target=script, argv=own)
    return writer, parsed(writer, tmp, monkeypatch), False


def command_problems(commands: list, tmp: Path, monkeypatch) -> tuple[list, int, int]:
    """(one line per command that does not do what it is shown doing, commands checked, resumes checked)."""
    bad, earlier, checked, resumes = [], [], 0, 0
    for n, shown in enumerate(commands):
        if shown.target.startswith("manual_train."):
            continue
        checked += 1
        try:
            cfg, why = parsed(shown, tmp / f"c{n}", monkeypatch), None
        except Exception as e:  # UsageError (validate's one line), argparse's, or a crash
            cfg, why = None, f"{type(e).__name__}: {e}"
        if cfg is not None and cfg.resume not in (None, "auto"):
            resumes += 1
            try:
                writer, wcfg, finished = resume_source(shown, cfg, earlier, tmp / f"w{n}", monkeypatch)
                why = wcfg if writer is None else resume_refusal(writer, wcfg, shown, cfg, finished)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            why = why and f"the resume rules refuse it: {why}"
        if shown.refused and why is None:
            bad.append(f"{shown.where}: {shlex.join(shown.argv)}: shown as refused, but accepted")
        elif why and not shown.refused:
            bad.append(f"{shown.where}: {shlex.join(shown.argv)}: {why}")
        if cfg is not None:
            earlier.append((shown, cfg))
    return bad, checked, resumes


def test_every_training_command_shown_parses_validates_and_resumes_as_shown(tmp_path, monkeypatch):
    """Every `python launch/...` and `torchrun ... launch/...` command in README.md, docs/ and the --help texts
    parses and passes validate() as its script would run it, and every `--resume` among them is one the resume
    rules (checkpoint.check_compatible) accept and that still has steps to train: resuming the checkpoint of the
    command that wrote that --out-dir earlier on the same page (finished), or, for `runs/<script>-<time>/` and
    `RUN/`, a run stopped after its first epoch ("continues where it stopped"). A table row's command whose
    outcome is an error must be refused. Templates (--nproc_per_node=N, `...` for flags) and `python -m` tools are
    left to the flag check above."""
    bad, checked, resumes = command_problems(shown_commands(), tmp_path, monkeypatch)
    assert not bad, "\n".join(bad)
    assert checked >= 200 and resumes >= 5, (checked, resumes)  # the collection itself has not gone blind


def test_the_command_check_catches_what_validate_and_the_resume_rules_refuse(tmp_path, monkeypatch):
    page = tmp_path / "rotten.md"
    page.write_text("""```
python launch/single.py --epochs 0
python launch/single.py --epochs 2 --out-dir A
python launch/single.py --resume A/last.pt --epochs 3
python launch/single.py --resume A/last.pt --epochs 2
python launch/single.py --resume B/last.pt
torchrun --nproc_per_node=2 launch/zero.py --schedule constant --epochs 1 --out-dir C
python launch/single.py --resume C/last.pt --schedule constant --epochs 2
torchrun --nproc_per_node=3 launch/tensor_parallel.py
```

| what you type | what happens |
|---|---|
| `python launch/single.py --epochs 3` | `error: ...` |
""")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(sys.modules[__name__], "LAUNCH_SCRIPTS", [])  # this page only
    bad, checked, resumes = command_problems(shown_commands(), tmp_path / "runs", monkeypatch)
    assert (checked, resumes) == (9, 4)
    expected = ["--epochs: 0 is out of range",  # validate()
                "--epochs: 3 changes the length of the cosine LR schedule",  # a resume that trains another run
                "nothing to do: the checkpoint's run is finished (all 94 steps done)",  # a resume that trains nothing
                "no command on this page writes --out-dir B",
                "global batch 32 differs from the checkpoint's 16",  # 2 ZeRO ranks x 8 -> one process x 32
                "--tp: 3 does not divide",
                "shown as refused, but accepted"]
    assert len(bad) == len(expected) and all(want in line for want, line in zip(expected, bad)), bad
