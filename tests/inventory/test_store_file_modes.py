"""The inventory's SQLite database, its -wal and a folder made for it are the owner's alone,
whatever the umask."""

from __future__ import annotations

import os
import stat

from inventory_svc.store import SqlStore


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_inventory_database_and_its_wal_are_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        os.chmod(tmp_path, 0o755)
        path = tmp_path / "inventory" / "inventory.db"
        store = SqlStore(path)
        try:
            store.upsert_node("10.0.0.1:50051", "10.0.0.1", "host", now=0.0)
            wal = path.with_name("inventory.db-wal")
            assert wal.exists()
            assert oct(mode(path)) == oct(0o600) and oct(mode(wal)) == oct(0o600)
            assert oct(mode(path.parent)) == oct(0o700)
            assert mode(tmp_path) == 0o755  # a folder it was pointed into is not its to change
        finally:
            store.close()
    finally:
        os.umask(old)
