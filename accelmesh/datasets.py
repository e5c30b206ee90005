"""Small data sets that ship inside the package, so demos and tests train on real data offline.

The 8x8 handwritten digits (UCI "Optical Recognition of Handwritten Digits", test set, as
distributed with scikit-learn): see accelmesh/data/README.md for source, licence and citation.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import io
from importlib import resources
from typing import NamedTuple

import numpy as np

from accelmesh.errors import InvalidArgument

DIGITS_RESOURCE = "data/digits.csv.gz"  # relative to the accelmesh package
DIGITS_ROWS = 1797
DIGITS_FEATURES = 64  # an 8x8 image, row-major
DIGITS_CLASSES = 10
DIGITS_MAX_PIXEL = 16  # each feature counts on-pixels in a 4x4 block: 0..16
# sha256 of the DECOMPRESSED csv text, so re-compressing the file does not break the check.
DIGITS_CSV_SHA256 = "6ebb3d2fee246a4e99363262ddf8a00a3c41bee6014c373ed9d9216ba7f651b8"


class Split(NamedTuple):
    """A train/test split; unpacks as (x_train, y_train, x_test, y_test)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as (x float32 [1797, 64] scaled to 0..1, y int32 [1797] in 0..9).

    Read from the package (works from a wheel or a zip), checksummed; each call returns fresh copies.
    """
    x, y = _digits()
    return x.copy(), y.copy()


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    resource = resources.files("accelmesh").joinpath(DIGITS_RESOURCE)
    try:
        compressed = resource.read_bytes()
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"accelmesh/{DIGITS_RESOURCE} is missing from the installed package; reinstall accelmesh "
            "(the wheel must include package data '*.csv.gz')") from error
    return _parse_digits(gzip.decompress(compressed))


def _parse_digits(text: bytes) -> tuple[np.ndarray, np.ndarray]:
    digest = hashlib.sha256(text).hexdigest()
    if digest != DIGITS_CSV_SHA256:
        raise ValueError(f"accelmesh/{DIGITS_RESOURCE} is corrupt: sha256 of its csv is {digest}, "
                         f"expected {DIGITS_CSV_SHA256}; reinstall accelmesh")
    table = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.float64)
    if table.shape != (DIGITS_ROWS, DIGITS_FEATURES + 1):
        raise ValueError(f"accelmesh/{DIGITS_RESOURCE}: shape {table.shape}, "
                         f"expected ({DIGITS_ROWS}, {DIGITS_FEATURES + 1})")
    pixels, labels = table[:, :DIGITS_FEATURES], table[:, DIGITS_FEATURES]
    if pixels.min() < 0 or pixels.max() > DIGITS_MAX_PIXEL or labels.min() < 0 or labels.max() >= DIGITS_CLASSES:
        raise ValueError(f"accelmesh/{DIGITS_RESOURCE}: pixels or labels out of range")
    x = (pixels / DIGITS_MAX_PIXEL).astype(np.float32)
    y = labels.astype(np.int32)
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y


def train_test_split(x: np.ndarray, y: np.ndarray, test_fraction: float = 0.2, seed: int = 0) -> Split:
    """A deterministic split stratified by label: each class gives round(test_fraction * its size)
    rows, chosen at random from ``seed``, to the test set. Rows keep their original order in both
    parts (shuffle per epoch with dispatch_svc.jobs.training_options.minibatches)."""
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 1 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise InvalidArgument(f"train_test_split: x has shape {x.shape} and y {y.shape}; "
                              "pass one label per row of x")
    if not isinstance(test_fraction, (int, float)) or isinstance(test_fraction, bool) \
            or not 0.0 < test_fraction < 1.0:
        raise InvalidArgument(f"test_fraction is {test_fraction!r}; pass a number strictly between 0 and 1")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InvalidArgument(f"seed is {seed!r}; pass a non-negative integer")
    rng = np.random.default_rng(seed)
    test_parts = []
    for label in np.unique(y):  # sorted, so the draw order does not depend on row order
        rows = np.flatnonzero(y == label)
        test_parts.append(rng.permutation(rows)[:int(round(test_fraction * rows.size))])
    test = np.sort(np.concatenate(test_parts)) if test_parts else np.zeros(0, np.int64)
    is_test = np.zeros(y.shape[0], dtype=bool)
    is_test[test] = True
    train = np.flatnonzero(~is_test)
    if train.size == 0 or test.size == 0:
        raise InvalidArgument(f"test_fraction {test_fraction} of {y.shape[0]} rows leaves an empty "
                              f"{'train' if train.size == 0 else 'test'} set; pass more rows or another fraction")
    return Split(x[train], y[train], x[test], y[test])
