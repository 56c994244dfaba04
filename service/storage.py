"""The decode service's SQLite database: handoff records and the webhook outbox, one file.

Opened by `kvhandoff.service.runtime.persistence` at start-up (`server.state_dir/decode.sqlite3`)
and used only from the event loop's thread, by `kvhandoff.service.records.handoffs` and
`kvhandoff.service.webhooks.outbox`. WAL mode with `synchronous=NORMAL`: a committed transaction is
in the WAL file before `commit` returns, so it survives the process being killed (SIGKILL, OOM);
only a power loss or kernel crash can lose the last transactions.

Group commit. A commit is most of a write's cost (about 200 us of the loop's time for one
statement here, 40 us for the statement alone), so the bus listener's writes join one open
transaction, `grouped()`, that commits at the first of: the next turn of the event loop, or
anything about to leave the process — an HTTP answer, a peer request, an SSE frame
(`kvhandoff.service.http.egress` waits for `committed`). Nothing outside the process can learn of a
state before it is on disk, as when each write committed alone; a process killed before the commit
loses only state nobody was told of. Work that must wait for the commit (a webhook delivery is
sent only once it is on disk) is queued with `after_commit`.

One process at a time: opening takes an exclusive lock (`flock`) on `<file>.lock` beside the
database, held until `close()` or the process ends (a SIGKILL releases it too), and writes who
holds it there; a second service on the same `state_dir` is refused at start naming the holder
(two would each restore the other's live handoffs as `service_restarted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

FILE_NAME = "decode.sqlite3"
#: The WAL file is truncated to this after a checkpoint (it is reused from its start anyway).
WAL_LIMIT_BYTES = 64 << 20
#: How long a group transaction stays open for more writes before it commits (0: until the
#: loop's next turn). Anything leaving the process meanwhile waits for the commit.
GROUP_WINDOW_S = 0.0
#: Bump with a migration below when the schema changes. 2: `handoffs.seq` (the list's order).
#: 3: `handoffs.progress` (stages and bytes of a handoff in flight, kept if the process dies).
#: 4: `handoffs.arena_base`/`arena_bytes` (the landing arena a handoff's writers wrote into:
#: what a restart must fence).
SCHEMA_VERSION = 4
#: A handoff's `seq` is `life << LIFE_SHIFT | n`, `n` its creation number in that life (1, 2, …):
#: 2**40 handoffs per life, 2**22 lives below the cursor's 2**62.
LIFE_SHIFT = 40

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- One row per accepted handoff. `state` is 'accepted' until a terminal event, then the terminal
-- state with its final `view`. `released`: its pages were given back (no write can land).
-- `seq`: creation order across lives (`LIFE_SHIFT`), what `GET /v1/handoffs` pages by.
-- `progress`: while in flight, its stages and bytes so far (what a restart-failed record shows).
-- `arena_base`, `arena_bytes`: the landing arena its prefills wrote into (landed mode); NULL in
-- direct mode and before schema 4 (a restart then fences its pages as direct ones).
CREATE TABLE IF NOT EXISTS handoffs (
    id TEXT PRIMARY KEY,
    request BLOB NOT NULL,
    dst_pages BLOB NOT NULL,
    created_at REAL NOT NULL,
    deadline_at REAL NOT NULL,
    state TEXT NOT NULL,
    view BLOB,
    finished_at REAL,
    released INTEGER NOT NULL DEFAULT 0,
    seq INTEGER,
    progress BLOB,
    arena_base INTEGER,
    arena_bytes INTEGER
);
CREATE INDEX IF NOT EXISTS handoffs_by_finish ON handoffs (finished_at);
CREATE TABLE IF NOT EXISTS endpoints (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    secret TEXT NOT NULL,
    types TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    handoff_id TEXT,
    created_at REAL NOT NULL,
    disabled_at REAL,
    disabled_reason TEXT
);
CREATE INDEX IF NOT EXISTS endpoints_by_handoff ON endpoints (handoff_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    type TEXT NOT NULL,
    handoff_id TEXT NOT NULL,
    body BLOB NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id INTEGER NOT NULL,
    endpoint_id TEXT NOT NULL,
    handoff_id TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    budget_from INTEGER NOT NULL DEFAULT 0,
    since REAL NOT NULL,
    next_at REAL NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    last_status INTEGER,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS deliveries_by_state ON deliveries (state, id);
CREATE INDEX IF NOT EXISTS deliveries_by_endpoint ON deliveries (endpoint_id, id);
CREATE TABLE IF NOT EXISTS attempts (
    delivery_id INTEGER NOT NULL,
    n INTEGER NOT NULL,
    at REAL NOT NULL,
    status INTEGER,
    latency_s REAL NOT NULL,
    error TEXT,
    PRIMARY KEY (delivery_id, n)
);
"""

# After the migrations: they add the columns these index. They keep a list call to its page of
# rows however many records there are: in creation order, and of the outcomes few records have.
# No index on every `state`: a record changes state at its outcome, and updating such an index
# took a handoff's two record writes from 38 to 47 us of CPU on the event loop; the partial
# index costs nothing to a handoff that completes, the seq index about 2 us (on insert only).
_INDEXES = """
CREATE INDEX IF NOT EXISTS handoffs_by_seq ON handoffs (seq);
CREATE INDEX IF NOT EXISTS handoffs_by_outcome ON handoffs (state, seq)
    WHERE state IN ('failed', 'aborted');
"""


class StateLocked(OSError):
    """Another process holds the database (its lock file names it)."""


def _lock(path: Path) -> int:
    """An fd holding the exclusive lock of `path`'s lock file, which now names this process;
    StateLocked naming the holder when another process has it."""
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise StateLocked(f"{path} is in use by {holder} (lock {lock_path})") from None
    except BaseException:
        os.close(fd)
        raise
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    command = " ".join(sys.argv)[:200]
    me = f"pid {os.getpid()} on {socket.gethostname()} since {since} ({command})"
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.encode(), 0)
    return fd


class Database:
    """One SQLite connection in autocommit mode; `transaction()` groups writes, `grouped()`
    joins the open group commit (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock_fd: int | None = _lock(path)
        try:
            self._open(path)
        except BaseException:  # a file this build refuses: give the lock back, then say why
            if "conn" in self.__dict__:
                self.conn.close()
            os.close(self._lock_fd)
            raise

    def _open(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        # 1 KiB pages (for a new file; fixed once it exists): a commit writes whole pages to the
        # WAL, and a handoff's record is well under 4 KiB, so this writes a third of the bytes.
        self.conn.execute("PRAGMA page_size=1024")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        # Checkpoints (the only writes that fsync) run in a thread (`checkpoint`), not in the
        # commit that happens to cross the threshold on the event loop.
        self.conn.execute("PRAGMA wal_autocheckpoint=0")
        self.conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")  # shrink after a burst
        self._checkpointer: sqlite3.Connection | None = None
        #: The group transaction is open (BEGIN ran; `commit` ends it).
        self._group = False
        self._after_commit: list[Callable[[], None]] = []
        self._before_commit: list[Callable[[], None]] = []
        self._waiters: list[asyncio.Future[None]] = []
        #: Called with the error when a group's commit fails (its writes are rolled back).
        self.on_commit_error: Callable[[Exception], None] | None = None
        self._checkpointing = threading.Lock()  # close() waits for a checkpoint in its thread
        self.conn.executescript(_SCHEMA)
        self.instance = self._meta("instance", secrets.token_hex(6))
        version = int(self._meta("schema_version", str(SCHEMA_VERSION)))
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{path} has schema version {version}, expected {SCHEMA_VERSION}")
        if version < SCHEMA_VERSION:
            with self.transaction() as tx:
                _migrate(tx, version)
        self.conn.executescript(_INDEXES)
        #: This opening of the file (1, 2, …; 0: records from before `seq` existed).
        self.life = int(self._meta("life", "0")) + 1
        self.conn.execute("UPDATE meta SET value = ? WHERE key = 'life'", (str(self.life),))

    def _meta(self, key: str, default: str) -> str:
        """The value of `key`, set to `default` first when absent."""
        self.conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (key, default))
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0])

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN … COMMIT (ROLLBACK on an exception). Inside an open transaction (nested, or
        the group) a savepoint: an exception undoes this block's writes only."""
        if self.conn.in_transaction:
            with self._savepoint():
                yield self.conn
            return
        self.conn.execute("BEGIN")  # one writing connection: no lock to take early
        try:
            yield self.conn
            for hook in self._before_commit:
                hook()
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    @contextlib.contextmanager
    def grouped(self) -> Iterator[sqlite3.Connection]:
        """Writes that join the group commit: they are on disk by the next turn of the loop,
        or before anything leaves the process (`commit`). An exception undoes this block's
        writes only. Without a running loop (a tool, a test) it is a plain transaction."""
        if not self.open_group():
            with self.transaction() as tx:
                yield tx
            return
        with self._savepoint():
            yield self.conn

    def open_group(self) -> bool:
        """Open the group transaction if it is not (its commit scheduled for the loop's next
        turn); False without a running loop (no group: write in plain transactions)."""
        if self._group or self.conn.in_transaction:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self.conn.execute("BEGIN")
        self._group = True
        if GROUP_WINDOW_S > 0:
            loop.call_later(GROUP_WINDOW_S, self.commit)
        else:
            loop.call_soon(self.commit)
        return True

    @contextlib.contextmanager
    def _savepoint(self) -> Iterator[None]:
        self.conn.execute("SAVEPOINT kvh")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK TO kvh")
            self.conn.execute("RELEASE kvh")
            raise
        self.conn.execute("RELEASE kvh")

    def before_commit(self, hook: Callable[[], None]) -> None:
        """Run `hook` inside every transaction just before it commits (writes noted in memory
        until then, `HandoffRecords.apply`)."""
        self._before_commit.append(hook)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run `fn` once what was written so far is on disk: now, if nothing is pending."""
        if self._group:
            self._after_commit.append(fn)
        else:
            fn()

    async def committed(self) -> None:
        """Until what was written so far is committed (or its commit failed: see
        `on_commit_error`). Every caller of one turn of the loop shares the one commit."""
        if self._group:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def commit(self) -> None:
        """Commit the open group, if any, then run what waited for it. Cheap when nothing is
        pending. A failed commit (or a failing `before_commit` hook) rolls the group back,
        drops what waited for it and reports the error to `on_commit_error`; the next write
        opens a new group either way."""
        if not self._group:
            return
        waiting, self._after_commit = self._after_commit, []
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # woken on the next turn, after the commit below
            if not waiter.done():
                waiter.set_result(None)
        try:
            for hook in self._before_commit:
                hook()
            self._group = False
            self.conn.execute("COMMIT")
        except Exception as exc:
            self._group = False
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            if self.on_commit_error is None:
                raise
            self.on_commit_error(exc)
            return
        for fn in waiting:
            fn()

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (PASSIVE: never blocks the writer). Call from a
        worker thread, one at a time (`asyncio.to_thread`)."""
        with self._checkpointing:
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(self.path, check_same_thread=False)
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def close(self) -> None:
        self.commit()
        with self._checkpointing:
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None
        self.conn.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


def _migrate(tx: sqlite3.Connection, version: int) -> None:
    """Bring a file of schema `version` up to `SCHEMA_VERSION` within `tx`: additive only, so
    the records an earlier release wrote stay readable by this one."""
    if version < 2:
        # Records from before `seq` are life 0, numbered in creation order.
        tx.execute("ALTER TABLE handoffs ADD COLUMN seq INTEGER")
        ids = tx.execute("SELECT id FROM handoffs ORDER BY created_at, id").fetchall()
        tx.executemany(
            "UPDATE handoffs SET seq = ? WHERE id = ?", [(n, i) for n, (i,) in enumerate(ids, 1)]
        )
    if version < 3:
        tx.execute("ALTER TABLE handoffs ADD COLUMN progress BLOB")
    if version < 4:
        # Records from before the arena stay NULL: fenced after a crash as direct ones are.
        tx.execute("ALTER TABLE handoffs ADD COLUMN arena_base INTEGER")
        tx.execute("ALTER TABLE handoffs ADD COLUMN arena_bytes INTEGER")
    tx.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
