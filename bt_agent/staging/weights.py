"""Stage every ``weights`` source at its ``mount_location`` before the first command runs.

1. Plan: list each source at a pinned version (an HF revision resolved to its commit; S3 ETags,
   GCS generations), filter with the patterns, and say what will be fetched.
2. Fetch what the node cache lacks, in parallel, after checking the free space.
3. Mount: hard-link every file from the cache into a staging directory beside the mount
   location, then rename it into place. A warm start costs one link per file, whatever the size.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from bt_agent.context import NodeContext
from bt_agent.errors import StagingError, StoreError, UsageError
from bt_agent.log import AgentLog, counted, format_bytes
from bt_agent.secrets import Secrets
from bt_agent.settings import (
    CLUSTER_CACHE_DIR_VARIABLE,
    DEFAULT_OUTAGE_SECONDS,
    NODE_CACHE_DIR_VARIABLE,
    STORE_OUTAGE_VARIABLE,
    Environ,
)
from bt_agent.spec.models import TrainingJob, WeightsAuthMethod, WeightsSource
from bt_agent.spec.urls import shown_url
from bt_agent.staging.cache import (
    ENTRY_MODE,
    Claim,
    NodeCache,
    copy_atomic,
    entry_id,
    left_by_stops,
)
from bt_agent.staging.patterns import anywhere, left_in_subdirectories, selected
from bt_agent.staging.progress import Progress
from bt_agent.storage import ObjectInfo, ObjectStore, open_store
from bt_agent.storage.base import Wanted
from bt_agent.storage.credentials import AwsRole
from bt_agent.storage.keys import check_key
from bt_agent.storage.retry import OutageWait
from bt_agent.storage.transfer import FETCH_WORKERS, each

#: Where a web identity token is, for ``AWS_OIDC`` (botocore's variable, as EKS sets it).
WEB_IDENTITY_TOKEN_VARIABLE = "AWS_WEB_IDENTITY_TOKEN_FILE"
#: What STS refuses in a role session's name (it takes ``[\w+=,.@-]``).
_SESSION_NAME_REFUSED = re.compile(r"[^\w+=,.@-]")


@dataclass(frozen=True)
class PlannedFile:
    relative: str
    info: ObjectInfo
    entry: str  # node cache entry id: what the content is, not where it is mounted


@dataclass(frozen=True)
class _Misses:
    """What the node cache lacks of a source: the files, their bytes, and how many of those a
    stopped staging wrote (its partial files, which their fills take up)."""

    files: list[PlannedFile]
    size: int
    written: int


@dataclass
class _Tally:
    """What one source's fetch did, counted from every fetching thread."""

    files: int = 0
    size: int = 0
    from_cluster: int = 0
    by_others: int = 0  # filled by another agent on the node while this one fetched
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fetched(self, item: PlannedFile, hit: bool = False) -> None:
        with self.lock:
            if hit:
                self.by_others += 1
            else:
                self.files += 1
                self.size += item.info.size

    def cluster_hit(self) -> None:
        with self.lock:
            self.from_cluster += 1

    def summary(self) -> str:
        notes = [counted(self.files, "file")]
        if self.from_cluster:
            notes.append(f"{self.from_cluster} from the cluster cache")
        if self.by_others:
            notes.append(f"{self.by_others} fetched by another agent meanwhile")
        return f"{format_bytes(self.size)} ({', '.join(notes)})"


@dataclass(frozen=True)
class TrainedCheckpoints:
    """Where ``bt://`` sources are found: the job's store, and the job that may not load its
    own checkpoints."""

    store_url: str
    job_id: str | None = None


@dataclass(frozen=True)
class SourcePlan:
    index: int
    weights: WeightsSource
    store: ObjectStore
    pinned: str  # the source at the version that was listed
    files: list[PlannedFile]
    mount: Path
    listed: int = 0  # objects under the source, selected or not
    some_keys: tuple[str, ...] = ()  # a few of their keys, for an error that says what is there
    #: Files in subdirectories left out only because a pattern's ``*`` stops at ``/``.
    shallow: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(f.info.size for f in self.files)


def _entry(store: ObjectStore, info: ObjectInfo) -> str:
    return entry_id(store.identity(info), info.key, info.version or "", str(info.size))


def plan_source(
    index: int, weights: WeightsSource, store: ObjectStore, mount: Path, only: str = ""
) -> SourcePlan:
    """The source's selected files (with ``only``, the one object of that key, if the store
    holds it); a key that would land outside the mount (``..``, an absolute path, a NUL) fails
    the plan with :class:`UnsafeKeyError` before any transfer."""
    if only:
        objects = [info for info in store.list(only) if info.key == only]
        pinned = store.uri(only)
    else:
        objects = store.list()
        pinned = store.pinned_uri()
    files = [
        PlannedFile(check_key(info.key), info, _entry(store, info))
        for info in objects
        if selected(info.key, weights.allow_patterns, weights.ignore_patterns)
    ]
    keys = tuple(info.key for info in objects[:3])
    allow, ignore = weights.allow_patterns, weights.ignore_patterns
    shallow = left_in_subdirectories([info.key for info in objects], allow, ignore)
    return SourcePlan(
        index, weights, store, pinned, files, mount, len(objects), keys, tuple(shallow)
    )


def _shallow(plan: SourcePlan) -> str:
    """What the allow patterns leave out in subdirectories, and how to take it."""
    allow = plan.weights.allow_patterns or []
    example = ", ".join(plan.shallow[:3])
    return (
        f"weights[{plan.index}] {plan.pinned}: allow_patterns {allow} leave out "
        f"{counted(len(plan.shallow), 'file')} in subdirectories that they match by name (such "
        f"as {example}): here * stops at /; write {anywhere(allow)} to take them too"
    )


def _nothing_selected(plan: SourcePlan) -> str:
    """Why a plan holds no file: nothing under the source, or patterns that leave nothing."""
    if not plan.listed:
        return "no file matches: nothing is under the source; check its path"
    weights = plan.weights
    patterns = " and ".join(
        f"{name} {value}"
        for name, value in (
            ("allow_patterns", weights.allow_patterns),
            ("ignore_patterns", weights.ignore_patterns),
        )
        if value
    )
    deeper = (
        f"; * stops at /: {anywhere(weights.allow_patterns or [])} would take "
        f"{counted(len(plan.shallow), 'file')} in subdirectories (such as {plan.shallow[0]})"
        if plan.shallow
        else ""
    )
    return (
        f"no file matches: {plan.listed} under the source (such as {', '.join(plan.some_keys)}), "
        f"none selected by {patterns}; check the patterns (matched against each key under the "
        f"source){deeper}"
    )


def aws_role(weights: WeightsSource, environ: Environ, job_id: str | None) -> AwsRole | None:
    """The IAM role the source's ``auth`` names (``AWS_ASSUME_ROLE``, ``AWS_OIDC``), its
    sessions named for the job (as AWS's logs show them); None for other sources."""
    auth = weights.auth
    if auth is None:
        return None
    session = _SESSION_NAME_REFUSED.sub("-", f"bt-agent-{job_id}" if job_id else "bt-agent")
    if auth.auth_method is WeightsAuthMethod.AWS_ASSUME_ROLE and auth.aws_assume_role_arn:
        return AwsRole(auth.aws_assume_role_arn, auth.aws_assume_role_region, session_name=session)
    if auth.auth_method is WeightsAuthMethod.AWS_OIDC and auth.aws_oidc_role_arn:
        return AwsRole(
            auth.aws_oidc_role_arn,
            auth.aws_oidc_region,
            "AWS_OIDC",
            session,
            environ.get(WEB_IDENTITY_TOKEN_VARIABLE),
        )
    return None


def stage_job_weights(
    job: TrainingJob,
    context: NodeContext,
    environ: Environ,
    secrets: Secrets,
    log: AgentLog,
    stopping: Callable[[], bool] = lambda: False,
) -> list[SourcePlan]:
    """Stage a job's weights through this node's cache (and the cluster tier, when set), then
    keep the cache within its budget (``BT_NODE_CACHE_MAX_BYTES``)."""
    host = context.layout.host
    cache = NodeCache.for_node(host, environ.get(NODE_CACHE_DIR_VARIABLE))
    cluster_dir = environ.get(CLUSTER_CACHE_DIR_VARIABLE)
    cluster = NodeCache(Path(cluster_dir)) if cluster_dir else None
    trained = TrainedCheckpoints(context.store_url, context.job_id)
    stager = WeightsStager(cache, log, environ, secrets.values, host, stopping, cluster, trained)
    plans = stager.stage(job.weights)
    if context.cache_budget is not None:
        if abandoned := cache.clear_abandoned(keep_resumable=True):
            log.info(f"node cache: removed {left_by_stops(abandoned)}")
        removed = cache.evict(context.cache_budget)
        if removed:
            freed = format_bytes(sum(e.size for e in removed))
            log.info(f"node cache: evicted {len(removed)} least recently used entries ({freed})")
    return plans


class WeightsStager:
    def __init__(
        self,
        cache: NodeCache,
        log: AgentLog,
        environ: Environ,
        secrets: dict[str, str],
        mount_path: Callable[[str], Path],
        stopping: Callable[[], bool] = lambda: False,
        cluster: NodeCache | None = None,
        checkpoints: TrainedCheckpoints | None = None,
    ) -> None:
        self.cache = cache
        self.cluster = cluster
        self.checkpoints = checkpoints
        self.log = log
        self.environ = environ
        self.secrets = secrets
        self.mount_path = mount_path
        self.stopping = stopping
        outage_seconds = environ.number(STORE_OUTAGE_VARIABLE, DEFAULT_OUTAGE_SECONDS)
        self.outage = OutageWait(
            outage_seconds, stopping, "the source", self.log.warning, self.log.info
        )

    def stage(self, sources: list[WeightsSource]) -> list[SourcePlan]:
        """Plan every source (a mistake in the last is found before the first downloads),
        then fetch and mount each; the sources' stores are closed when done."""
        plans: list[SourcePlan] = []
        try:
            for index, weights in enumerate(sources):
                plans.append(self._plan(index, weights))
            misses = [self._say_plan(plan) for plan in plans]
            for plan, missing in zip(plans, misses, strict=True):
                self._fetch(plan, missing)
                self._mount(plan)
        finally:
            for plan in plans:
                plan.store.close()
        return plans

    def _fail(
        self, plan_or_index: SourcePlan | int, weights: WeightsSource, exc: Exception
    ) -> StagingError:
        index = plan_or_index.index if isinstance(plan_or_index, SourcePlan) else plan_or_index
        said, source = str(exc), shown_url(weights.source)
        if said.startswith(source):  # a store's error names its object already
            return StagingError(f"weights[{index}] {said}")
        return StagingError(f"weights[{index}] {source}: {said}")

    def _open(self, index: int, weights: WeightsSource) -> ObjectStore:
        if weights.scheme == "bt":
            return self.outage.call(f"weights[{index}]", lambda: self._open_trained(weights))
        secret = self.secrets.get(weights.secret_name) if weights.secret_name else None
        job_id = self.checkpoints.job_id if self.checkpoints else None
        role = aws_role(weights, self.environ, job_id)
        return open_store(weights.source, self.environ, secret, weights.secret_name or "", role)

    def _open_trained(self, weights: WeightsSource) -> ObjectStore:
        from bt_agent.staging.trained import open_checkpoint_source

        where = self.checkpoints
        if where is None:
            raise UsageError("bt:// sources need the job's store (--store)")
        job_store = open_store(where.store_url, self.environ)
        return open_checkpoint_source(weights.source, job_store, where.job_id)

    def _plan(self, index: int, weights: WeightsSource) -> SourcePlan:
        try:
            store = self._open(index, weights)
        except (StoreError, StagingError, UsageError) as exc:
            raise self._fail(index, weights, exc) from exc
        try:
            mount = self.mount_path(weights.mount_location)
            plan = self.outage.call(
                f"weights[{index}]", lambda: plan_source(index, weights, store, mount)
            )
            if not plan.listed:
                plan = self._one_object(plan) or plan
        except (StoreError, UsageError) as exc:
            store.close()
            raise self._fail(index, weights, exc) from exc
        except BaseException:
            store.close()
            raise
        if plan.store is not store:  # the source names one object: its folder's store reads it
            store.close()
        if not plan.files:
            plan.store.close()
            raise self._fail(index, weights, ValueError(_nothing_selected(plan)))
        return plan

    def _one_object(self, plan: SourcePlan) -> SourcePlan | None:
        """Where nothing is under a source of an object store, the one object it may name
        (``s3://bucket/models/model.safetensors``), from a store of its folder: that file, at
        the mount as the file of an ``https://`` source is; None if there is none."""
        name = str(getattr(plan.store, "prefix", "")).rpartition("/")[2]
        weights = plan.weights
        if not name or weights.scheme == "bt":
            return None
        source = plan.store.url.rstrip("/").removesuffix(f"/{name}")
        folder = self._open(plan.index, replace(weights, source=source))
        try:
            found = self.outage.call(
                f"weights[{plan.index}]",
                lambda: plan_source(plan.index, weights, folder, plan.mount, only=name),
            )
        except BaseException:
            folder.close()
            raise
        if found.listed:
            return found
        folder.close()
        return None

    def _say_plan(self, plan: SourcePlan) -> _Misses:
        """Log what the plan holds and what the node cache lacks; return the latter."""
        if plan.shallow:
            self.log.warning(_shallow(plan))
        files = [f for f in plan.files if not self.cache.has(f.entry, f.info.size)]
        misses = _Misses(
            files,
            sum(f.info.size for f in files),
            sum(self.cache.written(f.entry) for f in files),
        )
        held = f"{counted(len(plan.files), 'file')}, {format_bytes(plan.size)}"
        fetch = format_bytes(misses.size)
        if misses.written:
            fetch += f", {format_bytes(misses.written)} of it written by a staging that stopped"
        self.log.info(
            f"weights[{plan.index}] {plan.pinned}: {held}; "
            f"{len(plan.files) - len(files)} in the node cache, {len(files)} to fetch "
            f"({fetch}) -> {plan.weights.mount_location}"
        )
        return misses

    def _fetch(self, plan: SourcePlan, misses: _Misses) -> None:
        """Fill the node cache with ``misses`` (another agent may fill some meanwhile)."""
        if not misses.files:
            return
        size, written = misses.size, misses.written
        need = size - written  # blocks still to be taken on disk
        free = self._prepare(plan)
        if need > free:
            raise self._fail(
                plan,
                plan.weights,
                OSError(
                    f"not enough disk space in the node cache {self.cache.root}: need "
                    f"{format_bytes(need)}, {format_bytes(free)} free; free space or lower "
                    "BT_NODE_CACHE_MAX_BYTES"
                ),
            )
        started = time.monotonic()
        tally = _Tally()
        try:
            with Progress(
                f"weights[{plan.index}]", size, self.log, self.log.stream, written=written
            ) as progress:
                rest = self._fetch_batch(plan, misses.files, progress, tally)
                self._fetch_each(plan, rest, progress, tally)
        except InterruptedError:
            raise
        except (StoreError, OSError) as exc:
            raise self._fail(plan, plan.weights, exc) from exc
        seconds = max(time.monotonic() - started, 1e-6)
        self.log.info(
            f"weights[{plan.index}] fetched {tally.summary()} in {seconds:.1f} s "
            f"({max(tally.size - written, 0) / seconds / 1e6:,.0f} MB/s)"
        )

    def _prepare(self, plan: SourcePlan) -> int:
        """The node cache's free bytes, its directory (and the cluster tier's) made first: one
        that cannot be made fails the plan naming the variable that moves it."""
        tiers = [(self.cache, "node", NODE_CACHE_DIR_VARIABLE)]
        if self.cluster is not None:
            tiers.append((self.cluster, "cluster", CLUSTER_CACHE_DIR_VARIABLE))
        for cache, tier, variable in tiers:
            try:
                cache.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                said = f"cannot make the {tier} cache {cache.root} ({exc.strerror})"
                fix = f"set {variable} to a directory this agent can write"
                raise self._fail(plan, plan.weights, OSError(f"{said}; {fix}")) from exc
        return shutil.disk_usage(self.cache.root).free

    def _fetch_each(
        self, plan: SourcePlan, items: list[PlannedFile], progress: Progress, tally: _Tally
    ) -> None:
        """One file per thread: large files (each in parallel ranges) and whatever a batch left."""

        def one(item: PlannedFile) -> None:
            self._check_stop()
            size = item.info.size
            _, hit = self.cache.ensure(
                item.entry, size, lambda path: self._fill(plan, item, path, tally, progress)
            )
            tally.fetched(item, hit)
            progress.add(size)

        each(one, items, FETCH_WORKERS, "bt-stage", self.stopping, plan.store.halt)

    def _fetch_batch(
        self, plan: SourcePlan, misses: list[PlannedFile], progress: Progress, tally: _Tally
    ) -> list[PlannedFile]:
        """Fetch the small misses in one batch, where the store has a batch path (many small
        files cost a thread each more than their transfer); the files left to fetch one by
        one: large ones, ones another agent is fetching, and any the batch could not place."""
        if self.cluster is not None:
            return misses  # each through the cluster tier's lock: one fetch per file per cluster
        small = [f for f in misses if plan.store.in_batches(f.info.size)]
        if not small:
            return misses
        left = [f for f in misses if not plan.store.in_batches(f.info.size)]
        held: dict[Path, tuple[PlannedFile, Claim]] = {}
        todo = iter(small)

        def claimed() -> Iterator[Wanted]:
            for item in todo:
                self._check_stop()
                claim = self.cache.claim(item.entry)
                if claim is None:
                    left.append(item)  # another agent is fetching it: wait for it there
                    continue
                if self.cache.has(item.entry, item.info.size):  # another agent fetched it
                    claim.release()
                    tally.fetched(item, hit=True)
                    progress.add(item.info.size)
                    continue
                path = self.cache.path(item.entry)
                held[path] = (item, claim)
                yield Wanted(path, item.info, mode=ENTRY_MODE)

        def finished(wanted: Wanted, error: Exception | None) -> None:
            item, claim = held.pop(wanted.destination)
            try:
                if error is not None:
                    left.append(item)
                    return
                self.cache.seal(wanted.destination)
                tally.fetched(item)
                progress.add(item.info.size)
            finally:
                claim.release()

        self.cache.prepare(f.entry for f in small)
        plan.store.download_batch(claimed(), finished)
        return left + list(todo)

    def _check_stop(self) -> None:
        if self.stopping():
            raise InterruptedError("stop requested")

    def _fill(
        self, plan: SourcePlan, item: PlannedFile, path: Path, tally: _Tally, progress: Progress
    ) -> None:
        """A node cache miss: from the source, or through the cluster tier where there is one.
        There the entry's lock is held while one node fetches it; the others wait on it and
        copy what it placed, so a file is fetched once per cluster however many nodes start
        together."""

        def download(target: Path) -> None:
            with progress.fetching(target, item.info.size):
                plan.store.download(
                    item.info.key,
                    target,
                    item.info,
                    self.outage.attempts(f"weights[{plan.index}]"),
                    resumable=True,
                )

        if self.cluster is None:
            download(path)
            return
        shared, hit = self.cluster.ensure(item.entry, item.info.size, download)
        copy_atomic(shared, path)
        if hit:
            tally.cluster_hit()

    def _mount(self, plan: SourcePlan) -> None:
        mount = plan.mount
        staging = mount.with_name(f".{mount.name}.staging-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        made: set[Path] = set()
        try:
            for item in plan.files:
                target = staging.joinpath(*item.relative.split("/"))
                if target.parent not in made:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    made.add(target.parent)
                _link_or_copy(self.cache.path(item.entry), target)
            _replace_dir(staging, mount)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise self._fail(plan, plan.weights, exc) from exc


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK, errno.EPERM):
            raise
        shutil.copyfile(source, target)  # another file system: copy
        target.chmod(0o444)


def _replace_dir(staging: Path, mount: Path) -> None:
    """Put ``staging`` at ``mount``; what was there before (an earlier job's mount) goes."""
    if mount.exists() or mount.is_symlink():
        old = mount.with_name(f".{mount.name}.old-{os.getpid()}")
        os.replace(mount, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(staging, mount)
