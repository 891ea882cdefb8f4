"""The flag mutants' machinery stays current (`make mutants-flags` runs the mutants; this checks, in `make test`, that
the hook changes what it claims in a fresh process, that every flag is a mutant, and that the kill matrix names
every one of them)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

from conftest import REPO

import flag_mutants
from manual_train.config import Config
from manual_train.parity import TOL_64

HOOK_PROBE = """
from manual_train.config import Config, parse_config
from manual_train.parity import build_parser
print(parse_config(Config, ["--lr", "0.2", "--no-progress", "--out-dir", "{out}"]).lr,
      parse_config(Config, ["--train-acc"]).train_acc, build_parser().parse_args(["--tol", "1"]).tol)
"""


def probe(tmp_path, mutant: str) -> tuple[list, list]:
    hits = tmp_path / f"hits-{len(list(tmp_path.iterdir()))}"
    env = {**os.environ, "FLAG_MUTANT": mutant, "FLAG_MUTANT_HITS": str(hits),
           "PYTHONPATH": os.pathsep.join([str(flag_mutants.HOOK), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", HOOK_PROBE.format(out=tmp_path / "run")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split(), (hits.read_text().splitlines() if hits.exists() else [])


def test_the_hook_ignores_the_named_flag_and_only_it_in_a_new_process(tmp_path):
    values, hits = probe(tmp_path, "config:Config:lr")
    assert values == ["0.05", "True", "1.0"] and len(hits) == 1 and "Config.lr: 0.2 -> 0.05" in hits[0]
    values, hits = probe(tmp_path, "argparse:python -m manual_train.parity:tol")  # (--lr 0.2 kept: only --tol)
    assert values[:2] == ["0.2", "True"] and float(values[2]) == TOL_64 and len(hits) == 1


def test_every_flag_is_a_mutant_and_the_kill_matrix_names_each():
    names = {m.name for m in flag_mutants.flag_mutants()}
    assert {f"Config.{f.name}" for f in dataclasses.fields(Config)} <= names
    assert {"parity.tol", "bench.quick", "GenerateArgs.temperature", "EvalArgs.eval_mode", "FindConfig.start",
            "TuneFlags.budget_s", "DDPConfig.comm_hook", "ZeroConfig.stage"} <= names
    assert set(flag_mutants.EQUIVALENT) <= names, "EQUIVALENT names a flag that no longer exists"
    listed = set(json.loads((REPO / "docs" / "mutants-flags.json").read_text())["mutants"])
    page = set(re.findall(r"^\| `([^`]+)` \|", (REPO / "docs" / "mutants-flags.md").read_text(), re.M))
    missing = sorted(names - listed)
    assert not missing, (f"flags not in docs/mutants-flags.md: {missing}; run "
                         f"`python tests/flag_mutants.py --only {','.join(missing)} --update`")
    assert page == listed == names, "docs/mutants-flags.md and its JSON are stale: run `make mutants-flags`"


def test_a_flag_runs_against_the_observing_tests_that_say_they_check_it():
    """A test of tests/test_flags_observed.py whose docstring names a flag is among that flag's selected tests, however
    long the other tests that pass its field are (--batch-size's selection once ranked three other tests, by length,
    above test_loader_flags_reach_the_dataloader, and its mutant survived)."""
    mutants = flag_mutants.flag_mutants()
    flag_mutants.select_tests(mutants)
    observing = [t for t in flag_mutants._test_texts() if t.file == flag_mutants.OBSERVED]
    checked = 0
    for m in mutants:
        saying = [t.node for t in observing if (not m.tool or m.tool in t.text)  # a tool's flag: its tests only
                  and m.flag.startswith("--") and re.search(rf"{re.escape(m.flag)}(?![\w-])", t.doc)]
        if saying:
            checked += 1
            assert set(m.tests) & set(saying), (m.name, saying, m.tests)
    by_name = {m.name: m for m in mutants}
    assert "tests/test_flags_observed.py::test_loader_flags_reach_the_dataloader" in by_name["Config.batch_size"].tests
    assert checked >= 40, checked


def test_a_tools_own_build_parser_is_mutated_too(tmp_path):
    """The tuner parses its TuneFlags with config.build_parser and parse_known_args, not parse_config."""
    env = {**os.environ, "FLAG_MUTANT": "config:TuneFlags:rounds",
           "PYTHONPATH": os.pathsep.join([str(flag_mutants.HOOK), str(REPO)])}
    code = ("from manual_train.config import build_parser; from manual_train.tune.cli import TuneFlags; "
            "print(build_parser(TuneFlags).parse_known_args(['--rounds', '5', '--lr', '1'])[0].rounds)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["2"], out.stderr[-2000:]
