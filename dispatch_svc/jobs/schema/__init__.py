"""The job book's schema (tables.py) and its Alembic migrations (env.py, versions/), one set for
SQLite and PostgreSQL. `accelmesh.runtime.database.migrate` runs them when a book opens."""

from pathlib import Path

SCRIPTS = Path(__file__).parent
VERSION_TABLE = "dispatch_alembic_version"
