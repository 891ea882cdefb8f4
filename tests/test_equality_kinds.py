"""The suite claims bit-for-bit equality only for one code path (the rule in tests/conftest.py).

A check written as `max_param_diff(a, b) == 0.0` does not say whether a and b came from one code path (a resume
and the uninterrupted run: bitwise on any CPU) or from two (FSDP2 and DDP: bitwise on one CPU, 2^-27 apart on
another). Such a check passed on an AVX-512 machine for months and failed on the first AVX2-only one. So the suite
names the kind of equality it claims: conftest.assert_same_path_bitwise, assert_cross_path_64 (64-true, <= 1e-9) or
assert_within_fp32_floor. This test reads every test file and fails on a difference compared with zero.
"""
from __future__ import annotations

import ast

from conftest import REPO

WORDS = ("diff", "deviation")  # max_param_diff(...), optimizer_deviation(...), diff, wrong_diff, ...


def _names_a_difference(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return any(word in name.lower() for word in WORDS)


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


def bitwise_claims(source: str) -> list[int]:
    """Line numbers of `<difference> == 0` or `<difference> <= 0` (either side, any zero literal)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if isinstance(op, (ast.Eq, ast.LtE, ast.GtE)) and (
                    (_names_a_difference(left) and _is_zero(right)) or (_is_zero(left) and _names_a_difference(right))):
                lines.append(node.lineno)
    return lines


def test_the_scan_finds_the_checks_that_failed_on_avx2():
    """Its power: the two checks this rule replaced, and the same claims spelled other ways, are found; the
    named helpers and comparisons with a bound are not."""
    wrong = ("assert max_param_diff(load_model_state(a), load_model_state(b)) == 0.0\n"
             "assert optimizer_deviation('sgd', impl) == 0.0\n"
             "diff = max_param_diff(a, b)\nassert diff == 0, diff\n"
             "assert 0.0 >= wrong_diff\n")
    assert bitwise_claims(wrong) == [1, 2, 4, 5]
    right = ("assert_same_path_bitwise(a, b, 'resume')\nassert_cross_path_64(a, b, 'fsdp2 vs ddp')\n"
             "assert max_param_diff(a, b) <= PARITY_TOL_64\nassert returncode == 0\nassert wrong_diff > 1e-3\n")
    assert bitwise_claims(right) == []


def test_no_test_compares_a_difference_with_zero():
    found = {f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "tests").glob("*.py"))
             for line in bitwise_claims(path.read_text())}
    assert not found, (f"{sorted(found)}: say which equality you claim (tests/conftest.py): assert_same_path_bitwise "
                       "for one code path, assert_cross_path_64 or assert_within_fp32_floor for two")
