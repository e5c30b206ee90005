"""A job's results on disk (dispatch_svc/jobs/results.py): what is written reads back exactly, a slab of
rows at a time or whole, for every dtype the mesh carries (bfloat16 among them) and for a scalar;
a file cut short on disk is a clear error, never rows of garbage."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from accelmesh import errors
from dispatch_svc.jobs.results import ResultStore


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, ml_dtypes.bfloat16])
def test_rows_written_out_of_order_read_back_by_slab_and_whole(tmp_path, dtype):
    store = ResultStore(tmp_path)
    value = (np.arange(7 * 3 * 5) % 251).astype(dtype).reshape(7, 3, 5)
    writer = store.create("job", "y", str(value.dtype), value.shape)
    writer.write_rows(4, value[4:])  # a later shard finished first
    writer.write_rows(0, value[:4])
    writer.close()
    (entry,) = store.entries("job")
    assert entry.read_rows(2, 6).dtype == value.dtype
    np.testing.assert_array_equal(entry.read_rows(2, 6), value[2:6])
    np.testing.assert_array_equal(entry.read_rows(3, 3), value[3:3])
    np.testing.assert_array_equal(entry.read(), value)


def test_a_scalar_result_reads_back_as_a_scalar(tmp_path):
    store = ResultStore(tmp_path)
    store.save("job", "loss", np.asarray(2.5, np.float32))
    (entry,) = store.entries("job")
    assert entry.read().shape == () and float(entry.read()) == 2.5


def test_a_result_file_cut_short_on_disk_names_the_result_and_what_is_missing(tmp_path):
    store = ResultStore(tmp_path)
    store.save("job", "y", np.ones((4, 8), np.float32))
    (entry,) = store.entries("job")
    with open(entry.path, "r+b") as file:
        file.truncate(3 * 8 * 4 + 6)  # three rows and a part of the fourth
    np.testing.assert_array_equal(entry.read_rows(0, 3), np.ones((3, 8), np.float32))
    with pytest.raises(errors.FailedPrecondition, match=r"result 'y' ends 26 bytes short"):
        entry.read_rows(2, 4)
