"""The job book's files on SQLite: jobs.db with its -wal, results and stored inputs, each its
owner's alone (0600, folders 0700) whatever the umask."""

from __future__ import annotations

import os
import stat

import numpy as np

from dispatch_svc.jobs import records as m
from dispatch_svc.jobs.book import JobBook
from dispatch_svc.jobs.stored_inputs import INPUT, PARAMETER

SPEC = m.JobSpec(program="mlp_classifier", inputs=(m.InputDecl("x", "float32", (4, 2)),))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_database_its_wal_results_and_inputs_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        data_dir = tmp_path / "dispatch"
        book = JobBook(data_dir, retention_s=60)
        try:
            job = book.create(SPEC)
            book.results.save(job.job_id, "logits", np.ones((4, 3), np.float32))
            book.inputs.save(job.job_id, PARAMETER + "w", np.ones((2, 2), np.float32))
            writer = book.inputs.create(job.job_id, INPUT + "x", "float32", (4, 2))
            writer.write_rows(0, np.zeros((4, 2), np.float32))
            writer.close()
            wal = data_dir / "jobs.db-wal"
            assert wal.exists()  # the book's engine keeps it while open
            files = [data_dir / "jobs.db", wal]
            folders = [data_dir]
            for store in (book.results, book.inputs):
                folders += [store.root, store.root / job.job_id]
                files += list((store.root / job.job_id).iterdir())
            assert {str(p): oct(mode(p)) for p in files if mode(p) != 0o600} == {}
            assert {str(p): oct(mode(p)) for p in folders if mode(p) != 0o700} == {}
            assert len(files) == 2 + 2 + 3  # db, wal; a result and its manifest; two inputs and their manifest
        finally:
            book.close()
    finally:
        os.umask(old)


def test_a_data_dir_and_database_made_before_are_tightened(tmp_path):
    old = os.umask(0o022)
    try:
        JobBook(tmp_path / "dispatch", retention_s=60).close()
        os.chmod(tmp_path / "dispatch", 0o755)
        os.chmod(tmp_path / "dispatch" / "jobs.db", 0o644)
        JobBook(tmp_path / "dispatch", retention_s=60).close()
        assert mode(tmp_path / "dispatch") == 0o700 and mode(tmp_path / "dispatch" / "jobs.db") == 0o600
    finally:
        os.umask(old)
