"""The sidecar's journal: what is durable in which store, and what was committed, kept in SQLite
on the node's disk so that an agent started again on the same checkpoint dir (the container
restarted) uploads only what is missing and commits what was left uncommitted.

A row is written only after the store has confirmed the upload; an agent killed in between
uploads the file again, which is harmless. One file serves every job and rank of a node root;
every row names its store, so that a job run again against another store (or a store whose
objects vanished) is never told that its files are safe: rows are for one store, and an
agent started again checks them against the store before it trusts them.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from bt_agent.settings import AGENT_STATE_DIR
from bt_agent.sidecar.files import FileSig

#: The journal, as a container path (mapped under the node root on local runs).
JOURNAL_CONTAINER_PATH = f"{AGENT_STATE_DIR}/sidecar-journal.sqlite"
#: Kept in SQLite's ``user_version``; a journal of another version starts anew (its rows only
#: spare uploads, so losing them costs time, never data).
VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    store TEXT NOT NULL, job_id TEXT NOT NULL, rank INTEGER NOT NULL, path TEXT NOT NULL,
    size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL,
    inode INTEGER NOT NULL, sha256 TEXT NOT NULL, uploaded_at REAL NOT NULL,
    PRIMARY KEY (store, job_id, rank, path)
);
CREATE INDEX IF NOT EXISTS files_by_path ON files (store, rank, path);
CREATE TABLE IF NOT EXISTS commits (
    store TEXT NOT NULL, job_id TEXT NOT NULL, rank INTEGER NOT NULL, checkpoint TEXT NOT NULL,
    signature TEXT NOT NULL, committed_at REAL NOT NULL,
    PRIMARY KEY (store, job_id, rank, checkpoint)
);
CREATE TABLE IF NOT EXISTS holds (
    store TEXT NOT NULL, job_id TEXT NOT NULL, rank INTEGER NOT NULL, checkpoint TEXT NOT NULL,
    reason TEXT NOT NULL, since_ns INTEGER NOT NULL,
    PRIMARY KEY (store, job_id, rank, checkpoint)
);
CREATE TABLE IF NOT EXISTS writing (
    store TEXT NOT NULL, job_id TEXT NOT NULL, rank INTEGER NOT NULL, checkpoint TEXT NOT NULL,
    PRIMARY KEY (store, job_id, rank, checkpoint)
);
"""
_OLD_TABLES = ("files", "commits", "holds", "writing")
EARLIER_WRITING = "an earlier job on this node was writing it in place when its agent stopped"


class Journal:
    """One job's node's view of the journal for one store; safe to use from several threads."""

    def __init__(self, path: Path, store: str, job_id: str, rank: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.store = store
        self.job_id = job_id
        self.rank = rank
        self._key = (store, job_id, rank)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable when a process is killed
        self._migrate()

    def _migrate(self) -> None:
        with self._db:
            (version,) = self._db.execute("PRAGMA user_version").fetchone()
            if version != VERSION:
                for table in _OLD_TABLES:
                    self._db.execute(f"DROP TABLE IF EXISTS {table}")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def durable(self) -> dict[str, tuple[FileSig, str]]:
        """This job's files uploaded to this store: path -> (signature when uploaded, sha256)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT path, size, mtime_ns, ctime_ns, inode, sha256 FROM files "
                "WHERE store=? AND job_id=? AND rank=?",
                self._key,
            ).fetchall()
        return {row[0]: (FileSig(row[1], row[2], row[3], row[4]), row[5]) for row in rows}

    def record_uploads(self, uploads: list[tuple[str, FileSig, str]]) -> None:
        """Record files the store confirmed: ``(path, signature, sha256)``, one transaction."""
        now = time.time()
        rows = [
            (*self._key, path, sig.size, sig.mtime_ns, sig.ctime_ns, sig.inode, sha256, now)
            for path, sig, sha256 in uploads
        ]
        with self._lock, self._db:
            self._db.executemany(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def forget_uploads(self, paths: Iterable[str]) -> None:
        """These files are not (or no longer) in the store after all."""
        rows = [(*self._key, path) for path in paths]
        with self._lock, self._db:
            self._db.executemany(
                "DELETE FROM files WHERE store=? AND job_id=? AND rank=? AND path=?", rows
            )

    def earlier_owner(self, path: str, sig: FileSig) -> tuple[str, str] | None:
        """The earlier job on this node root that already made this very file durable in this
        store (a checkpoint dir reused by local runs), if any: its id and the file's sha256."""
        with self._lock:
            row = self._db.execute(
                "SELECT job_id, sha256 FROM files WHERE store=? AND rank=? AND path=? AND size=? "
                "AND mtime_ns=? AND ctime_ns=? AND inode=? AND job_id != ? LIMIT 1",
                (
                    self.store,
                    self.rank,
                    path,
                    sig.size,
                    sig.mtime_ns,
                    sig.ctime_ns,
                    sig.inode,
                    self.job_id,
                ),
            ).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def commits(self) -> dict[str, str]:
        """This job's checkpoints committed to this store: name -> signature of what was
        committed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT checkpoint, signature FROM commits WHERE store=? AND job_id=? AND rank=?",
                self._key,
            ).fetchall()
        return {row[0]: row[1] for row in rows if row[1]}

    def record_commit(self, checkpoint: str, signature: str) -> None:
        """``signature`` is empty for a commit withdrawn."""
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO commits VALUES (?, ?, ?, ?, ?, ?)",
                (*self._key, checkpoint, signature, time.time()),
            )

    def holds(self) -> dict[str, tuple[str, int]]:
        """Checkpoints held back from a commit: name -> (reason, since when, ns)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT checkpoint, reason, since_ns FROM holds "
                "WHERE store=? AND job_id=? AND rank=?",
                self._key,
            ).fetchall()
        return {row[0]: (row[1], row[2]) for row in rows}

    def earlier_holds(self) -> dict[str, tuple[str, int | None]]:
        """What earlier jobs on this node root held back, or left being written in place (an
        agent that stopped mid-save), in this store and rank: name -> (reason, since when,
        ns; None for one left being written: the time that agent stopped is not known)."""
        where = "store=? AND rank=? AND job_id != ?"
        args = (self.store, self.rank, self.job_id)
        with self._lock:
            held = self._db.execute(
                f"SELECT checkpoint, reason, since_ns FROM holds WHERE {where}", args
            ).fetchall()
            writing = self._db.execute(
                f"SELECT checkpoint FROM writing WHERE {where}", args
            ).fetchall()
        found: dict[str, tuple[str, int | None]] = {
            row[0]: (EARLIER_WRITING, None) for row in writing
        }
        found.update({row[0]: (row[1], row[2]) for row in held})
        return found

    def record_hold(self, checkpoint: str, reason: str | None, since_ns: int = 0) -> None:
        """Hold ``checkpoint`` back (``reason``), or release it (None)."""
        with self._lock, self._db:
            if reason is None:
                self._db.execute(
                    "DELETE FROM holds WHERE store=? AND job_id=? AND rank=? AND checkpoint=?",
                    (*self._key, checkpoint),
                )
            else:
                self._db.execute(
                    "INSERT OR REPLACE INTO holds VALUES (?, ?, ?, ?, ?, ?)",
                    (*self._key, checkpoint, reason, since_ns),
                )

    def writing(self) -> set[str]:
        """Checkpoints being written in place, not yet settled, when last recorded."""
        with self._lock:
            rows = self._db.execute(
                "SELECT checkpoint FROM writing WHERE store=? AND job_id=? AND rank=?", self._key
            ).fetchall()
        return {row[0] for row in rows}

    def record_writing(self, checkpoint: str, writing: bool) -> None:
        with self._lock, self._db:
            if writing:
                self._db.execute(
                    "INSERT OR IGNORE INTO writing VALUES (?, ?, ?, ?)", (*self._key, checkpoint)
                )
            else:
                self._db.execute(
                    "DELETE FROM writing WHERE store=? AND job_id=? AND rank=? AND checkpoint=?",
                    (*self._key, checkpoint),
                )
