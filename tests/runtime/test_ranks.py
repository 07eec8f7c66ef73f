"""The one rank-spec grammar (``%%mesh --ranks``, the ``(mesh pdb)`` prompt) and the one
rank label of output, on their own: pure functions, no processes."""

from __future__ import annotations

import doctest

import pytest

from monarch_kernel.runtime import rank_sets
from monarch_kernel.runtime.rank_sets import SPEC_HELP, RankSpecError, parse_ranks, rank_label

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("spec, n, expect", [
    ("0", 4, [0]),
    ("3", 4, [3]),
    ("0-3", 4, [0, 1, 2, 3]),
    ("2-2", 4, [2]),
    ("0,2", 4, [0, 2]),
    (" 1 , 2 ", 4, [1, 2]),
    ("::2", 5, [0, 2, 4]),
    ("1::2", 6, [1, 3, 5]),
    ("1:", 4, [1, 2, 3]),
    (":2", 4, [0, 1]),
    ("::-1", 4, [0, 1, 2, 3]),  # a slice's order does not matter: ranks come out sorted
    ("0-2,5", 8, [0, 1, 2, 5]),
    ("3,0-1,::3", 7, [0, 1, 3, 6]),
    ("1,1,0-1", 4, [0, 1]),  # repeats count once
    (7, 8, [7]),  # an int is taken as its text
])
def test_specs_parse_to_sorted_unique_ranks(spec, n, expect):
    assert parse_ranks(spec, n) == expect


@pytest.mark.parametrize("spec", ["a", "", "0-", "-", "1-x", "1:2:3:4", "-2-3", "0,,1", "1.5"])
def test_what_does_not_parse_says_how_to_write_ranks(spec):
    with pytest.raises(RankSpecError) as info:
        parse_ranks(spec, 4)
    assert str(info.value) == f"{spec!r}: {SPEC_HELP}"


@pytest.mark.parametrize("spec", ["4", "-1", "0,4", "2-5"])
def test_ranks_the_mesh_does_not_have_name_the_ranks_it_has(spec):
    with pytest.raises(RankSpecError) as info:
        parse_ranks(spec, 4)
    assert str(info.value) == f"{spec!r}: the mesh has ranks 0-3"


def test_a_spec_that_names_no_rank_is_an_error():
    for spec in ("3-1", "5:"):
        with pytest.raises(RankSpecError):
            parse_ranks(spec, 4)
    with pytest.raises(RankSpecError, match="^'0': the mesh has no ranks$"):
        parse_ranks("0", 0)


def test_a_rank_spec_error_is_a_value_error():
    assert issubclass(RankSpecError, ValueError)


@pytest.mark.parametrize("given, label", [
    ([3], "[rank 3]"),
    ({0}, "[rank 0]"),
    ([0, 1], "[ranks 0-1]"),
    ([0, 1, 2, 5], "[ranks 0-2,5]"),
    ([5, 0, 2], "[ranks 0,2,5]"),
    ([0, 2, 4], "[ranks 0,2,4]"),
    ([1, 1, 2], "[ranks 1-2]"),
    ([7, 8, 9, 0, 3, 4], "[ranks 0,3-4,7-9]"),
    (range(16), "[ranks 0-15]"),
])
def test_rank_label(given, label):
    assert rank_label(given) == label


@pytest.mark.parametrize("spec", ["0", "0-3", "0,2", "::2", "1,3-5,7"])
def test_a_label_reads_back_as_the_same_ranks(spec):
    got = parse_ranks(spec, 8)
    label = rank_label(got)
    inner = label[len("[ranks "):-1] if label.startswith("[ranks ") else label[len("[rank "):-1]
    assert parse_ranks(inner, 8) == got


def test_the_module_examples_hold():
    result = doctest.testmod(rank_sets)
    assert result.attempted >= 3 and result.failed == 0
