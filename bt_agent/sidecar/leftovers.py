"""Uploads the sidecar leaves unfinished in the store, aborted.

A multipart upload still under way when the agent ends (its drain's deadline passed: a stop's
grace period, or the drain's own limit) is abandoned with the process, and S3 keeps the parts it
sent out of sight, billed, until the upload is aborted. The engine aborts the uploads that fail;
nothing aborts those of a process that ends. So as a drain ends with files not durable, its
store is halted (the uploads under way take no more parts, those waiting their turn do not
begin) and the multipart uploads left under the rank's checkpoints are aborted, on a thread of
their own while the records are written, and aborted again once the uploads under way have ended
(the parts they had on their way may land after the first abort); and an agent that starts on a
checkpoint dir that holds files (an earlier agent's on this node, which may have been killed
outright) aborts what is left there before its first upload (the rank is its own by then: a
second agent of it is refused).
What the process ends too soon to abort (its grace period spent), and what no agent comes back
for, a bucket's lifecycle rule (AbortIncompleteMultipartUpload) reclaims.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from bt_agent.catalog import Catalog, checkpoint_prefix
from bt_agent.errors import BtAgentError
from bt_agent.log import AgentLog, counted
from bt_agent.sidecar.commits import Owner


class Leftovers:
    """The aborts of one rank's unfinished multipart uploads, each on a thread of its own."""

    def __init__(self, catalog: Catalog, owner: Owner, log: AgentLog) -> None:
        self.catalog = catalog
        self.prefix = checkpoint_prefix(owner.project, owner.job_id, owner.rank, ".") + "/"
        self.log = log
        self._thread: threading.Thread | None = None

    def abort(self) -> None:
        """Abort, on a thread, the multipart uploads left unfinished under the rank's
        checkpoints (:meth:`wait` for it): an earlier agent's."""
        self._start(self._abort_left)

    def abandon(self) -> None:
        """For a drain that ends with uploads under way: halt the store (they take no more
        parts; those waiting their turn do not begin), and abort, on a thread, what is left,
        and again once those under way have ended (their parts on their way may land after
        the first abort)."""
        self.catalog.store.halt()
        self._start(self._abort_abandoned)

    def _start(self, abort: Callable[[], object]) -> None:
        self._thread = threading.Thread(target=abort, name="bt-upload-abort", daemon=True)
        self._thread.start()

    def wait(self, until: float | None = None) -> None:
        """Wait for the abort under way, until ``until`` (``time.monotonic()``) at most, or
        for as long as it takes: its requests' own timeouts bound it."""
        if self._thread is not None:
            self._thread.join(None if until is None else max(until - time.monotonic(), 0))

    def _abort_abandoned(self) -> None:
        if self._abort_left() and self.catalog.store.wait_uploads():
            self._abort_left()

    def _abort_left(self) -> bool:
        """Abort the uploads left under the rank's checkpoints; whether the store answered."""
        try:
            aborted = self.catalog.store.abort_uploads(self.prefix)
        except (BtAgentError, OSError) as exc:
            self.log.warning(f"checkpoints: {exc}")
            return False
        if aborted:
            uploads = counted(aborted, "multipart upload")
            self.log.info(f"checkpoints: aborted {uploads} left unfinished in the store")
        return True
