"""One run per node's directories, and one agent per job id and node rank.

Two runs on one node root (two local experiments started with the same ``--node-root``, or two
agents in one container) would share the working, checkpoint and scratch dirs: each one's
sidecar would upload the other's checkpoints as its own. The first run holds a lock on a file
of the agent's state dir for as long as it runs (:func:`node_lock`; the kernel lets go of it
when the process ends, however it ends); a second is refused with exit 2 before it writes
anything.


Two agents run as the same node of a job (an operator's mistake: the same ``--job-id`` and
``--node-rank`` twice) would write one node record, one log and one set of manifests over each
other's, and one's manifest could name bytes the store does not hold. The first agent writes a
claim where none is (a conditional write); a second finds another's claim and stops with exit 2
before it writes anything. The claim carries a token kept on the node's disk: an agent started
again on the same node (a restarted container) takes its own claim back, and a retry of the job
(a higher ``BT_RETRY_COUNT``) takes over the claim of the attempt before. The claim is given up
when the job ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from bt_agent.catalog import Catalog
from bt_agent.context import NodeContext
from bt_agent.errors import BtAgentError, UsageError
from bt_agent.records import Claim, now_iso
from bt_agent.settings import AGENT_STATE_DIR


class NodeClaim:
    def __init__(self, catalog: Catalog, context: NodeContext) -> None:
        self.catalog = catalog
        self.context = context
        name = f"{context.project}.{context.job_id}.rank-{context.node_rank}"
        self.token_path = context.layout.host(f"{AGENT_STATE_DIR}/claims/{name}")
        self._token: str | None = None

    def take(self) -> None:
        """Claim this node of the job, or raise :class:`UsageError` naming the agent that has
        it. Store errors propagate (an outage is waited out by the caller)."""
        ctx = self.context
        mine = Claim(
            self._own_token(),
            os.uname().nodename,
            os.getpid(),
            str(ctx.layout.node_root or "/"),
            now_iso(),
            ctx.retry_count,
        )
        held = self.catalog.claim(ctx.project, ctx.job_id, ctx.node_rank, mine, take=False)
        if held == mine:
            return
        if held.token != mine.token and held.retry >= mine.retry:
            raise UsageError(
                f"job {ctx.job_id} node rank {ctx.node_rank} is already run by another agent "
                f"(host {held.hostname}, pid {held.pid}, node root {held.node_root}, since "
                f"{held.started_at}): two agents must not share a job id and node rank; give "
                "this one another --job-id or --node-rank (a retry of the job sets "
                "BT_RETRY_COUNT higher)"
            )
        self.catalog.claim(ctx.project, ctx.job_id, ctx.node_rank, mine, take=True)

    def release(self) -> None:
        """Give the claim up, if it is still this node's (best effort: the next agent of the
        same node takes it back anyway)."""
        if self._token is None:
            return
        ctx = self.context
        with contextlib.suppress(BtAgentError, OSError):
            self.catalog.release(ctx.project, ctx.job_id, ctx.node_rank, self._token)

    def _own_token(self) -> str:
        """This node's token for the claim: the one an earlier agent here left, else new."""
        if self._token is None:
            try:
                self._token = self.token_path.read_text().strip() or None
            except OSError:
                self._token = None
        if self._token is None:
            self._token = os.urandom(16).hex()
            self.token_path.parent.mkdir(parents=True, exist_ok=True)
            self.token_path.write_text(self._token + "\n")
        return self._token


@contextlib.contextmanager
def node_lock(context: NodeContext) -> Iterator[None]:
    """This node's directories to this run alone while the block runs; :class:`UsageError`
    naming the run that holds them where another does."""
    path = context.layout.host(f"{AGENT_STATE_DIR}/run.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a run"
            root = context.layout.node_root
            where = f"the node root {root}" if root else "this container's job directories"
            raise UsageError(
                f"{where} is in use by {held}: two jobs there would share the working, "
                "checkpoint and scratch dirs (each would upload the other's checkpoints); give "
                "this run a node root of its own (--node-root), or wait for that one to end"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"job {context.job_id} (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)
