"""The packaged digits data set and the deterministic stratified split."""

from __future__ import annotations

import gzip
from importlib import resources

import numpy as np
import pytest

from accelmesh import datasets
from accelmesh.datasets import load_digits, train_test_split
from accelmesh.errors import InvalidArgument

# Per-class counts of the 1,797 digits (the UCI test set as shipped by scikit-learn).
DIGIT_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_digits_ship_inside_the_package_with_their_notice():
    data = resources.files("accelmesh").joinpath("data")
    blob = data.joinpath("digits.csv.gz").read_bytes()
    assert 50_000 < len(blob) < 65_000  # ~57 KB: the file is present, not an LFS pointer or a stub
    notice = data.joinpath("README.md").read_text(encoding="utf-8")
    for needed in ("BSD-3-Clause", "CC BY 4.0", "Alpaydin", "Kaynak", "scikit-learn"):
        assert needed in notice


def test_load_digits_shape_range_and_labels():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    # Pixels are counts 0..16 scaled by 1/16, so every value is a multiple of 1/16.
    np.testing.assert_array_equal(x * 16, np.round(x * 16))
    assert np.bincount(y, minlength=10).tolist() == DIGIT_COUNTS


def test_load_digits_returns_independent_copies():
    x, y = load_digits()
    x[:] = -1
    y[:] = -1
    x2, y2 = load_digits()
    assert x2.min() == 0.0 and y2.min() == 0
    assert x2.flags.writeable


def test_a_corrupted_file_is_refused():
    text = gzip.decompress(resources.files("accelmesh").joinpath(datasets.DIGITS_RESOURCE).read_bytes())
    x, y = datasets._parse_digits(text)
    assert x.shape == (1797, 64)
    with pytest.raises(ValueError, match="corrupt"):
        datasets._parse_digits(text.replace(b"0,0,5,13", b"0,0,5,14", 1))


def test_split_is_deterministic_disjoint_and_stratified():
    x, y = load_digits()
    rows = np.arange(len(y), dtype=np.float32)[:, None]  # the row number as the only feature
    a = train_test_split(rows, y, test_fraction=0.2, seed=0)
    b = train_test_split(rows, y, test_fraction=0.2, seed=0)
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)
    train_rows, test_rows = a.x_train[:, 0].astype(int), a.x_test[:, 0].astype(int)
    assert set(train_rows).isdisjoint(test_rows)
    assert sorted([*train_rows, *test_rows]) == list(range(len(y)))
    np.testing.assert_array_equal(a.y_train, y[train_rows])
    np.testing.assert_array_equal(a.y_test, y[test_rows])
    assert np.bincount(a.y_test, minlength=10).tolist() == [round(0.2 * n) for n in DIGIT_COUNTS]
    assert len(a.y_test) == 359 and len(a.y_train) == 1438
    other = train_test_split(rows, y, test_fraction=0.2, seed=1)
    assert not np.array_equal(other.x_test, a.x_test)


def test_split_unpacks_in_train_then_test_order():
    x, y = load_digits()
    x_train, y_train, x_test, y_test = train_test_split(x, y, test_fraction=0.25, seed=3)
    assert x_train.shape == (len(y_train), 64) and x_test.shape == (len(y_test), 64)
    assert abs(len(y_test) - 0.25 * len(y)) <= 10


@pytest.mark.parametrize("kwargs, field", [
    ({"test_fraction": 0.0}, "test_fraction"),
    ({"test_fraction": 1.0}, "test_fraction"),
    ({"test_fraction": True}, "test_fraction"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
])
def test_split_rejects_bad_arguments(kwargs, field):
    x, y = load_digits()
    with pytest.raises(InvalidArgument, match=field):
        train_test_split(x, y, **kwargs)


def test_split_rejects_mismatched_rows():
    x, y = load_digits()
    with pytest.raises(InvalidArgument, match="one label per row"):
        train_test_split(x, y[:-1])
