"""One agent per job id and node rank: a claim in the store, written before anything else.

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
import os

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
