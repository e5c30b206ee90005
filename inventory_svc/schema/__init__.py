"""The inventory's schema: its Alembic script directory (``versions/`` holds the revisions, oldest
first; ``env.py`` migrates on the connection it is passed), the table that records a database's
revision, and ``migrate``, which the store runs at open to bring a database to this build's head.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from accelmesh.errors import FailedPrecondition
from accelmesh.runtime import database

SCRIPTS = Path(__file__).resolve().parent
VERSION_TABLE = "inventory_alembic_version"


def migrate(engine: Engine) -> str:
    """Alembic to head; a database this build cannot bring there is refused, naming it and the fix."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util.exc import CommandError

    where = database.redacted(engine.url)
    try:
        return database.migrate(engine, SCRIPTS, version_table=VERSION_TABLE)
    except CommandError:
        # An unknown revision in the version table: written by a newer build, whose schema an
        # older one must not write into.
        with engine.connect() as conn:
            found = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
        head = ScriptDirectory(str(SCRIPTS)).get_current_head()
        raise FailedPrecondition(
            f"database {where} is at schema revision {found!r}, which this build of accelmesh does not know "
            f"(it knows up to {head}); run a newer accelmesh or point the inventory at another database"
        ) from None
    except FailedPrecondition as exc:
        raise FailedPrecondition(f"{where}: {exc}") from None
    except sa.exc.SQLAlchemyError as exc:
        reason = " ".join(str(getattr(exc, "orig", None) or exc).split())[:300]
        raise FailedPrecondition(
            f"database {where} cannot be opened ({reason}); point the inventory at a database it may write"
        ) from None
