"""The control plane's databases, one way for both engines: SQLAlchemy Core over SQLite or PostgreSQL.

A service names its database by a URL or, for SQLite, a plain file path (the embedded default):

    /var/lib/accelmesh/inventory.db             a SQLite file (WAL, foreign keys, a busy timeout)
    sqlite:///relative.db, sqlite:////abs.db    the same, as a SQLAlchemy URL
    postgresql://user:pw@host:5432/accelmesh    PostgreSQL through psycopg 3 (the driver is chosen here)

`open_engine` connects once before returning, so a database that cannot be reached stops a
service at start with a message naming the URL (its password left out). Its schema is brought up
to date by Alembic (`migrate`), one set of migrations for both engines. `transaction` runs a unit
of work and retries it when PostgreSQL aborts it for a serialisation failure or a deadlock (two
replicas touching the same rows); a database that goes away mid-call becomes UNAVAILABLE, never
INTERNAL, and the pool's pre-ping replaces dead connections once it is back.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Engine, make_url

from accelmesh import errors
from accelmesh.runtime.config import env_int
from accelmesh.security.files import create_private, private_dir, tighten_private

log = logging.getLogger(__name__)

T = TypeVar("T")

# A statement that runs longer is cancelled by PostgreSQL (the service's call then fails, it does
# not hang); ACCELMESH_DB_STATEMENT_TIMEOUT_MS may change it.
DEFAULT_STATEMENT_TIMEOUT_MS, STATEMENT_TIMEOUT_ENV = 30_000, "ACCELMESH_DB_STATEMENT_TIMEOUT_MS"
POOL_SIZE, POOL_OVERFLOW = 8, 8
# Each pooled SQLite connection keeps a page cache of its own (2 MiB by default), filled as the file
# grows; the file is local, so the kernel's page cache holds the same pages once for all of them.
SQLITE_CACHE_KIB = 512
RETRIES = 6
# SQLSTATEs PostgreSQL aborts a transaction with that is right to run again as it was.
_RETRYABLE_SQLSTATES = {"40001", "40P01"}  # serialization_failure, deadlock_detected
READ_ONLY = "accelmesh_read_only"  # an execution option: this connection only reads


def database_url(target: str | Path) -> URL:
    """`target` as a SQLAlchemy URL: a path is a SQLite file; postgres:// means psycopg 3."""
    text = str(target)
    if "://" not in text:
        return URL.create("sqlite", database=text)
    try:
        url = make_url(text)
    except sa.exc.ArgumentError as exc:
        raise errors.InvalidArgument(f"database URL {redacted(text)!r} does not parse ({exc}); "
                                     "use a file path or postgresql://user@host/dbname") from None
    if url.drivername in ("postgres", "postgresql", "postgresql+psycopg"):
        return url.set(drivername="postgresql+psycopg")
    if url.drivername == "sqlite":
        return url
    raise errors.InvalidArgument(f"database URL {redacted(text)!r}: {url.drivername!r} is not supported; "
                                 "use a SQLite file path or a postgresql:// URL")


def redacted(target: str | Path | URL) -> str:
    """The URL as it may be logged or sent back: without its password."""
    if isinstance(target, URL):
        return target.render_as_string(hide_password=True)
    text = str(target)
    if "://" not in text:
        return text
    try:
        return make_url(text).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return text.split("://", 1)[0] + "://…"


def _as_typed(url: URL) -> URL:
    return url.set(drivername="postgresql") if url.drivername == "postgresql+psycopg" else url


def is_postgres(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql"


def open_engine(target: str | Path, *, service: str, statement_timeout_ms: int | None = None) -> Engine:
    """An engine on `target`, connected once. FailedPrecondition, naming the URL, when it cannot be."""
    url = database_url(target)
    if statement_timeout_ms is None:
        statement_timeout_ms = env_int(STATEMENT_TIMEOUT_ENV, DEFAULT_STATEMENT_TIMEOUT_MS, os.environ, minimum=1)
    if url.drivername == "sqlite":
        if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
            _private_sqlite_file(Path(url.database))
        engine = sa.create_engine(url, poolclass=sa.pool.SingletonThreadPool if url.database == ":memory:" else None,
                                  connect_args={"check_same_thread": False, "timeout": 5.0})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        sa.event.listen(engine, "begin", _sqlite_begin)
    else:
        engine = sa.create_engine(
            url, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW, pool_pre_ping=True, pool_recycle=1800,
            connect_args={"application_name": f"accelmesh-{service}", "connect_timeout": 10,
                          "options": f"-c statement_timeout={int(statement_timeout_ms)}"})
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as exc:
        engine.dispose()
        raise errors.FailedPrecondition(
            f"database {redacted(target)} cannot be opened: {_reason(exc)}; "
            + ("point it at a SQLite file it may write" if url.drivername == "sqlite" else
               "check that the server runs, the URL's host, port, user and database, and the password")) from None
    return engine


@functools.lru_cache(maxsize=64)
def _upsert(dialect: str, table: sa.Table, update: Callable[[sa.ColumnCollection], dict] | None, same: str):
    statement = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)
    keys = [column.name for column in table.primary_key.columns]
    if update is None:
        values = {c.name: statement.excluded[c.name] for c in table.columns if c.name not in keys}
    else:
        values = update(statement.excluded)
    if not same:
        return statement.on_conflict_do_update(index_elements=keys, set_=values)
    fenced = statement.on_conflict_do_update(index_elements=keys, set_=values,
                                             where=table.c[same] == statement.excluded[same])
    return fenced.returning(*table.primary_key.columns)  # no row back: fenced off (rowcount says -1 on psycopg)


def upsert(conn: Connection | Engine, table: sa.Table, update: Callable[[sa.ColumnCollection], dict] | None = None,
           *, same: str = ""):
    """An insert into ``table`` that, on a primary-key clash, sets what ``update(excluded)`` returns,
    or (without ``update``) every non-key column to the inserted value. Both engines spell it
    INSERT ... ON CONFLICT DO UPDATE, but SQLAlchemy builds it from each dialect's own ``insert``.
    With ``same``, a row whose column of that name differs from the inserted one is left as it
    is, and the statement returns no row (it returns the key otherwise): a fence, e.g. on the
    writer that holds the row.
    Built once per dialect and ``update`` (a module-level function), as a poll cycle runs it per node."""
    return _upsert(conn.dialect.name, table, update, same)


def _private_sqlite_file(path: Path) -> None:
    """The database file made 0600 before SQLite first opens it: SQLite creates the -wal, -shm and
    -journal files with the main file's mode, so all of them are the owner's alone. A file of this
    process's own left by an earlier version is tightened, with its -wal and -shm."""
    private_dir(path.parent, tighten=False)  # the folder may be anyone's (/tmp); missing ones are made 0700
    create_private(path)
    for suffix in ("-wal", "-shm", "-journal"):
        sibling = path.with_name(path.name + suffix)
        if sibling.exists():
            tighten_private(sibling)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # The driver's own transaction handling off: `_sqlite_begin` issues BEGIN IMMEDIATE, so a
    # writer takes the lock at the start and never fails to upgrade a read lock mid-transaction.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON", "busy_timeout=5000",
                   f"cache_size=-{SQLITE_CACHE_KIB}"):
        cursor.execute(f"PRAGMA {pragma}")  # with WAL, NORMAL survives a process crash and commits cheaply
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    # A reader (`connected`) shares the file with writers under WAL; a writer locks it at once.
    read = connection.get_execution_options().get(READ_ONLY, False)
    # On the driver's connection itself: a statement through SQLAlchemy costs as much again as the
    # (tiny) write it opens.
    connection.connection.driver_connection.execute("BEGIN" if read else "BEGIN IMMEDIATE")


def _reason(exc: BaseException) -> str:
    original = getattr(exc, "orig", None) or exc
    return " ".join(str(original).split())[:300] or type(original).__name__


def retryable(exc: BaseException) -> bool:
    original = getattr(exc, "orig", None)
    return getattr(original, "sqlstate", None) in _RETRYABLE_SQLSTATES


def unavailable(exc: sa.exc.SQLAlchemyError, engine: Engine) -> Exception:
    """What a failed database call answers: UNAVAILABLE when the server is gone (try again later);
    anything else is a bug of the caller's (INTERNAL, logged with its traceback by the server)."""
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)):
        return errors.Unavailable(f"the database {redacted(_as_typed(engine.url))} is not answering ({_reason(exc)}); "
                                  "try again when it is back")
    return RuntimeError(f"database error: {_reason(exc)}")


@contextmanager
def connected(engine: Engine) -> Iterator[Connection]:
    """A connection for reads (one snapshot until it closes); errors as `unavailable` says."""
    try:
        with engine.connect().execution_options(**{READ_ONLY: True}) as connection:
            yield connection
    except sa.exc.SQLAlchemyError as exc:
        raise unavailable(exc, engine) from None


def ping(engine: Engine) -> None:
    """Raise Unavailable unless the database answers a trivial query now (a readiness check)."""
    with connected(engine) as connection:
        connection.execute(sa.text("SELECT 1"))


def transaction(engine: Engine, work: Callable[[Connection], T], *, attempts: int = RETRIES,
                reraise: tuple[type[Exception], ...] = ()) -> T:
    """`work` in one transaction, run again (after a short random wait) when the database aborted it
    for a serialisation failure or deadlock. `work` must be safe to repeat: it gets a fresh transaction.
    Errors of the `reraise` types (say, IntegrityError for a caller that expects a clash) pass as they are."""
    for attempt in range(1, attempts + 1):
        try:
            with engine.begin() as connection:
                return work(connection)
        except reraise:
            raise
        except sa.exc.DBAPIError as exc:
            if retryable(exc) and attempt < attempts:
                time.sleep(random.uniform(0, 0.01 * 2 ** attempt))
                continue
            raise unavailable(exc, engine) from None
        except sa.exc.SQLAlchemyError as exc:
            raise unavailable(exc, engine) from None
    raise AssertionError("unreachable")


def migrate(engine: Engine, script_location: Path, *, version_table: str) -> str:
    """Bring the schema to Alembic's head; returns the revision it is at. Concurrent replicas
    starting at once on PostgreSQL take turns (an advisory lock), so each migration runs once."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

    config = Config()
    config.set_main_option("script_location", str(script_location))
    config.attributes["version_table"] = version_table
    with engine.begin() as connection:
        if is_postgres(engine):
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": version_table})
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
        return MigrationContext.configure(connection, opts={"version_table": version_table}).get_current_revision()


def run_migrations_online() -> None:
    """The body of every service's Alembic env.py: migrate on the connection `migrate` passed."""
    from alembic import context

    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through accelmesh.runtime.database.migrate, which passes a connection")
    context.configure(connection=connection, version_table=context.config.attributes["version_table"],
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
