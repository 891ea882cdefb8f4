"""The mutant catalogue: the bugs people make in each technique, written as minimal edits of this repository's own
technique code, and the tests that must fail on each (`make mutants` applies them one at a time; tests/run_mutants.py).

A mutant is a text edit of one file under manual_train/ (a marked loop line or the library function it calls): `old`
must occur exactly once, and is replaced by `new` in a temporary copy of the repository, never in the working tree.
The kill run is `pytest -x` on `kill` (test node ids) in that copy; a mutant is killed when a test fails with an
assertion (or the named symptom: a timeout, a one-line error the test expects not to see). An error of another kind
(an import error, a missing fixture) is not a kill: the runner reports it as broken, and the gate fails.

`env` is extra environment for the kill run: tests/jobs.py reads JOB_SCENARIOS to run only the scenarios the named
tests read (a multi-rank job's other scenarios cost minutes and prove nothing about this mutant).
`demo` is the gallery's run: a launch script and its arguments (and torchrun's process count), run once with the
mutant and once without; the gallery reports both runs' final validation loss and accuracy. A resume bug shows only in
a resumed run: `demo_stop` stops the run after that many optimizer steps and resumes it to its end (the command
needs --schedule constant, whose length may change across a resume). A mutant without a demo says why in `no_demo`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mutant:
    name: str  # a slug, unique: docs/mutants.md and docs/bug-gallery.md name it
    technique: str  # the group in the kill matrix and the gallery (TECHNIQUES below)
    file: str  # relative to the repository root
    old: str  # occurs exactly once in `file`
    new: str
    says: str  # one line: the bug, as people write it
    kill: tuple[str, ...]  # pytest node ids, run in order with -x
    report: str = ""  # the public report it mirrors, where one exists
    env: dict = field(default_factory=dict)
    demo: tuple = ()  # (script, nproc or 0 for plain python, *argv)
    demo_stop: int = 0  # > 0: the gallery run stops after this many steps (--max-steps) and resumes (--resume auto)
    no_demo: str = ""  # without a demo: why the gallery cannot show this bug in a run (it says so in the entry)


# The techniques, in the order of the kill matrix and the gallery, and the docs page each links from.
TECHNIQUES = {
    "accumulation": "docs/accumulation.md",
    "dataparallel": "docs/data_parallel.md",
    "model-parallel": "docs/model_parallel.md",
    "hybrid": "docs/hybrid.md",
    "ddp": "docs/ddp.md",
    "zero": "docs/zero.md",
    "pipeline": "docs/pipeline.md",
    "tensor-parallel": "docs/tensor_parallel.md",
    "precision": "docs/precision.md",
    "levers": "docs/levers.md",
    "resume": "docs/checkpointing.md",
    "evaluation": "docs/evaluation.md",
}


def catalogue() -> list[Mutant]:
    """Every mutant, in the order of TECHNIQUES (each module of this package lists its own in MUTANTS)."""
    import importlib
    import pkgutil

    everything = [m for info in pkgutil.iter_modules(__path__)
                  for m in importlib.import_module(f"{__name__}.{info.name}").MUTANTS]
    order = list(TECHNIQUES)
    return sorted(everything, key=lambda m: order.index(m.technique))
