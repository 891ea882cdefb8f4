"""The mutant machinery stays current (`make mutants` runs all of it; this runs a little of it in `make test`).

  names .......... the catalogue (tests/mutants/), the kill matrix (docs/mutants.md) and the gallery
                   (docs/bug-gallery.md) name the same mutants in the same order; at least 45; every one applies
                   exactly once to today's code, and the last full run killed every one
  end to end ..... the 6 mutants the last full run killed fastest are applied to a temporary copy again and their
                   killers run: each must still be killed (a killer that stopped failing, or a mutant whose text
                   no longer matches, fails here)
"""
from __future__ import annotations

import re

import pytest
from conftest import REPO
from mutants import catalogue
from run_mutants import TARGETS, Outcome, check, gallery_entry, invisible, kill, page_counts

MIN_MUTANTS = 45
CHEAPEST = 6
ROW = re.compile(r"^\| [^|]+ \| `([^`]+)` \| .* \| (\d+) s \|$", re.M)


def _matrix_rows() -> list[tuple[str, int]]:
    """(name, seconds) of each row of docs/mutants.md; none without the page (the names test then fails)."""
    page = REPO / "docs" / "mutants.md"
    return [(name, int(seconds)) for name, seconds in ROW.findall(page.read_text())] if page.exists() else []


def test_catalogue_matrix_and_gallery_name_the_same_mutants():
    names = [m.name for m in catalogue()]
    assert len(names) >= MIN_MUTANTS, f"{len(names)} mutants; the catalogue promises at least {MIN_MUTANTS}"
    assert [name for name, _ in _matrix_rows()] == names, "docs/mutants.md is stale: run `make mutants`"
    gallery = re.findall(r"^### `([^`]+)`$", (REPO / "docs" / "bug-gallery.md").read_text(), re.M)
    assert gallery == names, "docs/bug-gallery.md is stale: run `make mutants`"
    for m in catalogue():
        check(m)  # applies exactly once, changes something, names a technique and its killers
    matrix = (REPO / "docs" / "mutants.md").read_text()
    assert f"{len(names)} of {len(names)} killed." in matrix


def test_the_gallerys_header_counts_the_demos_that_learn_as_its_entries_say():
    """The header says how many correct runs reached their task's target and how many stayed below, as the entries
    do (a header that said every demo learns, above 40 entries below their target, is what this catches)."""
    page = (REPO / "docs" / "bug-gallery.md").read_text()
    head = re.search(r"here (\d+) did, (\d+) stayed below, and (\d+) have no\s+target", page)
    assert head, "docs/bug-gallery.md's header does not count the demos that reached their target"
    reached, below, none = page_counts(page)
    assert [int(n) for n in head.groups()] == [reached, below, none]
    assert below == 0, f"{below} demos' correct runs stay below their task's target: a bug's cost shows only in a run " \
                       "that learns (give the demo a size or length where it does)"


def test_the_targets_read_the_right_number_on_the_right_side():
    """Digits by val accuracy from below, pydoc by bits per byte (the loss in nats / ln 2) from above."""
    run = {"final_val_acc": 0.95, "final_val_loss": 2.18 * 0.6931471805599453}
    assert TARGETS["digits"].reached(run) and not TARGETS["reverse"].reached(run)
    assert TARGETS["pydoc"].reached(run)
    assert not TARGETS["pydoc"].reached(run | {"final_val_loss": 2.19 * 0.6931471805599453})
    assert not TARGETS["digits"].reached(run | {"final_val_acc": 0.9499})


def test_a_bookkeeping_bug_shows_in_what_the_run_reports_not_as_nothing():
    """A bug that leaves the validation numbers alone but halves samples_seen or changes the logged train loss is
    visible to a user (summary.json, metrics.csv): its entry says so and does not call it invisible."""
    correct = {"final_val_loss": 0.1228, "final_val_acc": 0.9596, "samples_seen": 6000, "last_train_loss": 0.0399}
    assert invisible(correct, dict(correct))
    assert invisible(correct, correct | {"final_val_loss": 0.1228 * 1.0099, "last_train_loss": 0.0399 * 0.9901})
    assert not invisible(correct, correct | {"final_val_loss": 0.1228 * 1.011})
    halved = correct | {"samples_seen": 3000}
    assert not invisible(correct, halved)
    assert not invisible(correct, correct | {"last_train_loss": 0.0450})
    mutant = next(m for m in catalogue() if m.name == "ddp-samples-seen-per-rank")
    entry = " ".join(gallery_entry(mutant, Outcome(mutant.name, "killed", "t", "", "", 1.0),
                                   {"correct": correct, "mutant": halved}))
    assert "samples_seen 6000 correct, 3000 with the bug" in entry and "changes nothing" not in entry


def test_a_mutant_without_a_demo_says_why_and_its_entry_says_it_too():
    """The gallery shows each bug in a run, or says why it cannot (six entries ended at their test without a word)."""
    page = (REPO / "docs" / "bug-gallery.md").read_text()
    for m in catalogue():
        assert bool(m.demo) != bool(m.no_demo), f"{m.name}: a demo, or a reason in no_demo why none (not both)"
        entry = page.split(f"### `{m.name}`", 1)[1].split("\n### ", 1)[0]
        if m.no_demo:
            assert f"No demo: {m.no_demo}" in " ".join(entry.split()), f"{m.name}: its entry does not say why no demo"


def _cheapest() -> list[str]:
    return [name for name, _ in sorted(_matrix_rows(), key=lambda row: row[1])[:CHEAPEST]]


@pytest.mark.parametrize("name", _cheapest())
def test_a_cheap_mutant_is_still_killed(name):
    mutant = next(m for m in catalogue() if m.name == name)
    outcome = kill(mutant)
    print(f"{name}: {outcome.status} by {outcome.test} in {outcome.seconds:.0f} s ({outcome.message[:120]})")
    assert outcome.status == "killed", outcome
