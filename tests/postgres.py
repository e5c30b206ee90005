"""A real PostgreSQL server for the tests, started in a temporary directory on a Unix socket only.

The store and job-book suites run once on SQLite and once here. The server is found as
`initdb`/`pg_ctl` on PATH, under ACCELMESH_TEST_POSTGRES_BIN, or in the distribution's
/usr/lib/postgresql/<version>/bin. PostgreSQL refuses to run as root: as root the server runs as
the `postgres` user the distribution's package creates. With no server to be had, the PostgreSQL
variants are skipped with one line saying how to enable them, unless ACCELMESH_REQUIRE_POSTGRES=1
(CI), which makes that a failure. Nothing listens on TCP, so no port can clash.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

BIN_ENV, REQUIRE_ENV = "ACCELMESH_TEST_POSTGRES_BIN", "ACCELMESH_REQUIRE_POSTGRES"
HOW_TO_ENABLE = ("PostgreSQL variants skipped: no PostgreSQL server binaries found; install them "
                 "(Debian: apt-get install postgresql) or set ACCELMESH_TEST_POSTGRES_BIN to the folder holding initdb")


def _parent_of(stat: Path) -> int:
    """The parent pid in a /proc/<pid>/stat file (the field after the parenthesised command); -1
    for a process gone meanwhile."""
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def find_binaries() -> Path | None:
    candidates = [os.environ.get(BIN_ENV, "")]
    found = shutil.which("initdb")
    candidates.append(str(Path(found).resolve().parent) if found else "")
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in filter(None, candidates):
        if (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    return None


class PostgresServer:
    """One throwaway cluster; `database()` gives each test a database of its own."""

    def __init__(self, binaries: Path, *, durable_commits: bool = False):
        """`durable_commits`: a commit is in the server's log on disk before it returns, so a
        server SIGKILLed (`kill`) keeps every transaction it said was committed, as a production
        server does. Off (the tests' default, for speed), a crash loses the last ~200 ms of them."""
        self._bin = binaries
        self._synchronous_commit = "on" if durable_commits else "off"
        self._as: list[str] = []
        self.root = Path(tempfile.mkdtemp(prefix="am-pg-"))  # short: a socket path has ~100 characters
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root, and there is no 'postgres' user to run the server as") from None
            os.chmod(self.root, 0o755)
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.data, self.socket = self.root / "data", self.root
        self._run("initdb", "-D", str(self.data), "-U", "accelmesh", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    def start(self) -> None:
        """Start the server on its data folder (again, after `kill`: it recovers from its WAL first)."""
        # fsync and full-page writes guard against the machine's crash, not a process's: left off
        options = (f"-c listen_addresses='' -c unix_socket_directories={self.socket} -c fsync=off "
                   f"-c synchronous_commit={self._synchronous_commit} -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w", "start")

    def kill(self) -> int:
        """SIGKILL the postmaster and every backend of it, as a crash of its machine would end
        them (a backend left running keeps the shared memory, and the next start would refuse it);
        returns the postmaster's pid. `start` brings the server back."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        backends = [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")
                    if _parent_of(stat) == postmaster]
        for pid in [postmaster, *backends]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in [postmaster, *backends]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return postmaster

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self._as, str(self._bin / tool), *args], capture_output=True, text=True)
        if done.returncode != 0:
            log = self.root / "server.log"
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}"
                               + (f"\n{log.read_text()[-2000:]}" if log.exists() else ""))

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://accelmesh@/{database}?host={self.socket}"

    def database(self) -> str:
        """A new, empty database; its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        with self._admin() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def _admin(self):
        import psycopg

        return psycopg.connect(f"host={self.socket} user=accelmesh dbname=postgres", autocommit=True)

    def allow_connections(self, url: str, allowed: bool) -> None:
        """As an operator takes a database away (and gives it back): refuse new sessions and end
        the live ones, or let them in again. The server itself stays up for the other tests."""
        import sqlalchemy as sa

        name = sa.make_url(url).database
        with self._admin() as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allowed else "false"}')
            if not allowed:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
