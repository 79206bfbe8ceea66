"""The job spec as the platform's SDK (``truss_train``, truss 0.18.35) defines it.

Field names, defaults and strictness follow the SDK exactly (REFERENCE.md §1): objects are strict
with unknown keys forbidden, except where the SDK itself is lax (``WeightsSource`` and
``WeightsAuth`` keep unknown keys; an accelerator's ``"count": "8"`` is taken as 8; an auth
method is upper-cased). Each type is declared once: its fields carry their validators
(``s.rule``) and its object validator is derived from them (``s.schema_for``). Checks the SDK
does not make (overlapping directories, unsupported references) live in ``checks``; secrets are
resolved in ``bt_agent.secrets``.
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field
from typing import Any

from bt_agent.errors import Problem
from bt_agent.spec import schema as s
from bt_agent.spec.bt_uri import SCHEME as BT_SCHEME
from bt_agent.spec.bt_uri import BadCheckpointURI, parse_checkpoint_uri
from bt_agent.spec.urls import CLOUD_SCHEMES

SUPPORTED_SCHEMES = (*CLOUD_SCHEMES, "hf://", "https://", BT_SCHEME)  # bt:// is ours
DEFAULT_CHECKPOINT_DIR = "/mnt/ckpts"  # ours: the docs name /tmp/training_checkpoints too
DEFAULT_LOAD_DIR = "/tmp/loaded_checkpoints"

Found = list[tuple[str, str, str]]


def _text(default: Any = MISSING, min_length: int = 0) -> Any:
    """A string field: required without a default, else also null."""
    if default is MISSING:
        return s.rule(s.string(min_length))
    return s.rule(s.nullable(s.string(min_length)), default)


_STR_LIST = s.list_of(s.string())


# --- secrets and accelerators -------------------------------------------------------------------


@dataclass(frozen=True)
class SecretReference:
    """``{"name": ...}``: the value of the workspace secret with that name."""

    name: str = _text()


SECRET_REFERENCE = s.schema_for(SecretReference)


class Accelerator(str, enum.Enum):
    B10 = "B10"
    T4 = "T4"
    L4 = "L4"
    A10G = "A10G"
    V100 = "V100"
    A100 = "A100"
    A100_40GB = "A100_40GB"
    H100 = "H100"
    H200 = "H200"
    H100_40GB = "H100_40GB"
    B200 = "B200"
    L40S = "L40S"
    RTX_PRO_6000 = "RTX_PRO_6000"
    B300 = "B300"
    GB300 = "GB300"


@dataclass(frozen=True)
class AcceleratorSpec:
    accelerator: Accelerator | None = s.rule(s.nullable(s.choice(Accelerator)), None)
    count: int = s.rule(s.integer(minimum=0, lax=True), 1)
    extra: dict[str, Any] = field(default_factory=dict)


_ACCELERATOR_OBJECT = s.schema_for(AcceleratorSpec, extra="allow")


def _accelerator_string(value: str) -> Any:
    name, _, count = value.strip().partition(":")
    if name not in Accelerator._value2member_map_:
        known = ", ".join(a.value for a in Accelerator)
        return ("unsupported accelerator type " + repr(name), f"use one of: {known}")
    if count and (not count.isdigit() or int(count) <= 0):
        return (f"invalid count {count!r} in {value!r}", "write a positive integer, as in 'H100:8'")
    return AcceleratorSpec(Accelerator(name), int(count or 1))


def _accelerator(value: Any, path: str, problems: list[Problem]) -> Any:
    if isinstance(value, str):
        parsed = _accelerator_string(value)
        if isinstance(parsed, tuple):
            problems.append(Problem(path, *parsed))
            return s.INVALID
        return parsed
    return _ACCELERATOR_OBJECT(value, path, problems)


class AvailabilityModel(str, enum.Enum):
    DEDICATED = "dedicated"
    SPOT = "spot"


@dataclass(frozen=True)
class Compute:
    node_count: int = s.rule(s.integer(), 1)
    cpu_count: int = s.rule(s.integer(), 1)
    memory: str = s.rule(s.string(), "2Gi")
    accelerator: AcceleratorSpec | None = s.rule(s.nullable(_accelerator), None)
    availability_model: AvailabilityModel = s.rule(
        s.choice(AvailabilityModel), AvailabilityModel.DEDICATED
    )

    @property
    def gpu_count(self) -> int:
        accel = self.accelerator
        return accel.count if accel is not None and accel.accelerator is not None else 0


# --- checkpoints --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LatestCheckpoint:
    """``baseten_latest_checkpoint``. Neither field set: the current job's project (ours)."""

    typ: str = s.rule(s.string(), "baseten_latest_checkpoint")
    job_id: str | None = _text(None)
    project_name: str | None = _text(None)


@dataclass(frozen=True, kw_only=True)
class NamedCheckpoint:
    typ: str = s.rule(s.string(), "baseten_named_checkpoint")
    checkpoint_name: str = _text()
    job_id: str = _text()


@dataclass(frozen=True, kw_only=True)
class LoopsCheckpoint:
    """Accepted by the SDK; bt-agent cannot load it and says so in ``checks``."""

    typ: str = s.rule(s.string(), "loops_checkpoint")
    run_id: str = _text()
    checkpoint_name: str = _text()
    target: str = s.rule(s.string(), "trainer")


CheckpointReference = LatestCheckpoint | NamedCheckpoint | LoopsCheckpoint

CHECKPOINT_SCHEMAS: dict[str, s.Validator] = {
    "baseten_latest_checkpoint": s.schema_for(LatestCheckpoint),
    "baseten_named_checkpoint": s.schema_for(NamedCheckpoint),
    "loops_checkpoint": s.schema_for(LoopsCheckpoint),
}


def _checkpoint_tag(value: Any) -> str | None:
    """The reference's ``typ``; without one, the first kind whose fields it has, as the SDK's
    union takes it (every kind's ``typ`` has a default), else the latest checkpoint's."""
    if not isinstance(value, dict):
        return None
    if "typ" not in value:
        fits = (
            tag
            for tag, schema in CHECKPOINT_SCHEMAS.items()
            if schema(value, "", []) is not s.INVALID
        )
        return next(fits, "baseten_latest_checkpoint")
    typ = value["typ"]
    return typ if isinstance(typ, str) else None


def _unknown_checkpoint(value: Any) -> tuple[str, str]:
    kinds = ", ".join(CHECKPOINT_SCHEMAS)
    if not isinstance(value, dict):
        return (
            f"expected a checkpoint reference object, got {s.describe(value)}",
            f'write {{"typ": ..., ...}} with typ one of: {kinds}',
        )
    return (f"unknown checkpoint reference typ {value.get('typ')!r}", f"use one of: {kinds}")


@dataclass(frozen=True)
class LoadCheckpointConfig:
    enabled: bool = s.rule(s.boolean(), False)
    checkpoints: list[CheckpointReference] = s.rule(
        s.list_of(s.tagged(_checkpoint_tag, CHECKPOINT_SCHEMAS, _unknown_checkpoint)),
        default_factory=lambda: [LatestCheckpoint()],
    )
    download_folder: str = s.rule(s.string(), DEFAULT_LOAD_DIR)


@dataclass(frozen=True)
class CheckpointingConfig:
    enabled: bool = s.rule(s.boolean(), False)
    checkpoint_path: str | None = _text(None)
    volume_size_gib: int | None = s.rule(s.nullable(s.integer()), None)


# --- the runtime --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheConfig:
    enabled: bool = s.rule(s.boolean(), False)
    enable_legacy_hf_mount: bool = s.rule(s.boolean(), False)
    require_cache_affinity: bool = s.rule(s.boolean(), True)
    mount_base_path: str = s.rule(s.string(), "/root/.cache")


def _env_tag(value: Any) -> str | None:
    return "secret" if isinstance(value, dict) else "str" if isinstance(value, str) else None


def _bad_env_value(value: Any) -> tuple[str, str]:
    return (
        f"expected a string or a secret reference, got {s.describe(value)}",
        'write a string in quotes, or {"name": "<secret name>"} for a secret',
    )


def _one_cache_setting(raw: dict[str, Any]) -> Found:
    if raw.get("enable_cache") is not None and raw.get("cache_config") is not None:
        return [
            (
                "enable_cache",
                "enable_cache and cache_config are both set",
                "remove enable_cache (deprecated) and use cache_config with enabled=true "
                "and enable_legacy_hf_mount=true",
            )
        ]
    return []


@dataclass(frozen=True)
class Runtime:
    start_commands: list[str] = s.rule(_STR_LIST, default_factory=list)
    environment_variables: dict[str, str | SecretReference] = s.rule(
        s.dict_of(
            s.tagged(_env_tag, {"str": s.string(), "secret": SECRET_REFERENCE}, _bad_env_value)
        ),
        default_factory=dict,
    )
    enable_cache: bool | None = s.rule(s.nullable(s.boolean()), None)
    checkpointing_config: CheckpointingConfig = s.rule(
        s.schema_for(CheckpointingConfig), default_factory=CheckpointingConfig
    )
    load_checkpoint_config: LoadCheckpointConfig | None = s.rule(
        s.nullable(s.schema_for(LoadCheckpointConfig)), None
    )
    cache_config: CacheConfig | None = s.rule(s.nullable(s.schema_for(CacheConfig)), None)
    # Wire-only: the deploy step adds the uploaded code here. Kept, never interpreted.
    artifacts: list[Any] | None = s.rule(s.nullable(s.list_of(s.any_json())), None)

    @property
    def cache(self) -> CacheConfig:
        """The effective cache settings, ``enable_cache`` migrated the way the SDK does."""
        if self.cache_config is not None:
            return self.cache_config
        enabled = bool(self.enable_cache)
        return CacheConfig(enabled=enabled, enable_legacy_hf_mount=enabled)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpointing_config.checkpoint_path or DEFAULT_CHECKPOINT_DIR

    @property
    def load_dir(self) -> str:
        config = self.load_checkpoint_config
        return config.download_folder if config is not None else DEFAULT_LOAD_DIR

    @property
    def checkpoints_to_load(self) -> list[CheckpointReference]:
        config = self.load_checkpoint_config
        return list(config.checkpoints) if config is not None and config.enabled else []


RUNTIME = s.schema_for(Runtime, before=_one_cache_setting)


# --- weights ------------------------------------------------------------------------------------


class WeightsAuthMethod(str, enum.Enum):
    CUSTOM_SECRET = "CUSTOM_SECRET"
    AWS_OIDC = "AWS_OIDC"
    GCP_OIDC = "GCP_OIDC"
    AWS_ASSUME_ROLE = "AWS_ASSUME_ROLE"


AUTH_FIELDS: dict[WeightsAuthMethod, tuple[str, ...]] = {
    WeightsAuthMethod.CUSTOM_SECRET: ("auth_secret_name",),
    WeightsAuthMethod.AWS_OIDC: ("aws_oidc_role_arn", "aws_oidc_region"),
    WeightsAuthMethod.GCP_OIDC: ("gcp_oidc_service_account", "gcp_oidc_workload_id_provider"),
    WeightsAuthMethod.AWS_ASSUME_ROLE: ("aws_assume_role_arn", "aws_assume_role_region"),
}


@dataclass(frozen=True)
class WeightsAuth:
    auth_method: WeightsAuthMethod = s.rule(s.choice(WeightsAuthMethod, upper=True))
    auth_secret_name: str | None = _text(None)
    aws_oidc_role_arn: str | None = _text(None)
    aws_oidc_region: str | None = _text(None)
    gcp_oidc_service_account: str | None = _text(None)
    gcp_oidc_workload_id_provider: str | None = _text(None)
    aws_assume_role_arn: str | None = _text(None)
    aws_assume_role_region: str | None = _text(None)
    extra: dict[str, Any] = field(default_factory=dict)


def _auth_fields_match_method(auth: WeightsAuth) -> Found:
    required = AUTH_FIELDS[auth.auth_method]
    others = {f for fields in AUTH_FIELDS.values() for f in fields} - set(required)
    method = auth.auth_method.value
    found: Found = [
        (name, f"must be provided when auth_method is {method}", "add it")
        for name in required
        if getattr(auth, name) in (None, "")
    ]
    found += [
        (name, f"cannot be specified when auth_method is {method}", "remove it")
        for name in sorted(others)
        if getattr(auth, name) not in (None, "")
    ]
    return found


WEIGHTS_AUTH = s.schema_for(WeightsAuth, extra="allow", checks=(_auth_fields_match_method,))


def _source_rule(value: str) -> tuple[str, str] | None:
    schemes = ", ".join(sorted(SUPPORTED_SCHEMES))
    if "://" not in value:
        scheme, colon, rest = value.partition(":")
        meant = f"{scheme}://{rest.lstrip('/')}" if colon else ""
        hint = (
            f"write it as {meant}"
            if f"{scheme}://" in SUPPORTED_SCHEMES and rest.strip("/")
            else f"start it with one of: {schemes}"
        )
        return (f"source {value!r} is missing a URI scheme", hint)
    scheme = value.split("://", 1)[0] + "://"
    rest = value[len(scheme) :]
    if scheme not in SUPPORTED_SCHEMES:
        return (f"unsupported source scheme {scheme!r}", f"use one of: {schemes}")
    if scheme == BT_SCHEME:
        try:
            parse_checkpoint_uri(value)
        except BadCheckpointURI as exc:
            return (exc.problem, exc.hint)
        return None
    name = scheme[:-3].upper()
    forms = {
        "https://": "https://hostname/path",
        "hf://": "hf://owner/repo[@revision] (a dataset: hf://datasets/owner/repo)",
    }
    if not rest or rest.startswith("/"):
        form = forms.get(scheme, f"{scheme}bucket/path")
        return (f"invalid {name} URI {value!r}", f"expected format: {form}")
    if scheme in CLOUD_SCHEMES and "@" in rest:
        return (
            "the @ revision syntax is only valid for HuggingFace sources (hf://)",
            f"remove the @... suffix: {name} has no revisions",
        )
    return None


def _absolute_rule(value: str) -> tuple[str, str] | None:
    if value.startswith("/"):
        return None
    return (
        f"mount_location must be an absolute path (start with /), got: {value}",
        f"write it as /{value}",
    )


@dataclass(frozen=True)
class WeightsSource:
    source: str = s.rule(s.refined(s.string(1), _source_rule))
    mount_location: str = s.rule(s.refined(s.string(1), _absolute_rule))
    auth: WeightsAuth | None = s.rule(s.nullable(WEIGHTS_AUTH), None)
    auth_secret_name: str | None = _text(None)
    allow_patterns: list[str] | None = s.rule(s.nullable(_STR_LIST), None)
    ignore_patterns: list[str] | None = s.rule(s.nullable(_STR_LIST), None)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def secret_name(self) -> str | None:
        if self.auth_secret_name:
            return self.auth_secret_name
        return self.auth.auth_secret_name if self.auth is not None else None


def _one_secret_name(weights: WeightsSource) -> Found:
    if weights.auth_secret_name and weights.auth is not None and weights.auth.auth_secret_name:
        return [
            (
                "auth_secret_name",
                "auth_secret_name is set both here and in auth",
                "keep only one of the two",
            )
        ]
    return []


WEIGHTS_SOURCE = s.schema_for(WeightsSource, extra="allow", checks=(_one_secret_name,))


# --- the image ----------------------------------------------------------------------------------


class DockerAuthType(str, enum.Enum):
    GCP_SERVICE_ACCOUNT_JSON = "GCP_SERVICE_ACCOUNT_JSON"
    AWS_IAM = "AWS_IAM"
    AWS_OIDC = "AWS_OIDC"
    GCP_OIDC = "GCP_OIDC"
    REGISTRY_SECRET = "REGISTRY_SECRET"
    AWS_ASSUME_ROLE = "AWS_ASSUME_ROLE"


DOCKER_AUTH_FIELDS = {
    DockerAuthType.AWS_IAM: "aws_iam_docker_auth",
    DockerAuthType.AWS_OIDC: "aws_oidc_docker_auth",
    DockerAuthType.AWS_ASSUME_ROLE: "aws_assume_role_docker_auth",
    DockerAuthType.GCP_OIDC: "gcp_oidc_docker_auth",
    DockerAuthType.GCP_SERVICE_ACCOUNT_JSON: "gcp_service_account_json_docker_auth",
    DockerAuthType.REGISTRY_SECRET: "registry_secret_docker_auth",
}


def _docker_auth_fields_match_method(auth: dict[str, Any]) -> Found:
    method = auth["auth_method"]
    required = DOCKER_AUTH_FIELDS[method]
    found: Found = []
    if auth[required] is None:
        found.append((required, f"must be provided when auth_method is {method.value}", "add it"))
    found += [
        (name, f"cannot be specified when auth_method is {method.value}", "remove it")
        for name in DOCKER_AUTH_FIELDS.values()
        if name != required and auth[name] is not None
    ]
    return found


def _plain(**fields: s.Validator) -> s.Validator:
    """A strict object of required fields, kept as a dict (registry credentials are the
    platform's business: validated as the SDK does, never used)."""
    return s.nullable(s.ObjectSchema(dict, {k: s.Field(v) for k, v in fields.items()}))


_ROLE = _plain(role_arn=s.string(1), region=s.string(1))
DOCKER_AUTH: s.ObjectSchema[dict[str, Any]] = s.ObjectSchema(
    dict,
    {
        "auth_method": s.Field(s.choice(DockerAuthType)),
        "registry": s.Field(s.string()),
        "aws_iam_docker_auth": s.Field(
            _plain(
                access_key_secret_ref=SECRET_REFERENCE,
                secret_access_key_secret_ref=SECRET_REFERENCE,
            ),
            None,
        ),
        "aws_oidc_docker_auth": s.Field(_ROLE, None),
        "aws_assume_role_docker_auth": s.Field(_ROLE, None),
        "gcp_oidc_docker_auth": s.Field(
            _plain(service_account=s.string(1), workload_identity_provider=s.string(1)), None
        ),
        "gcp_service_account_json_docker_auth": s.Field(
            _plain(service_account_json_secret_ref=SECRET_REFERENCE), None
        ),
        "registry_secret_docker_auth": s.Field(_plain(secret_ref=SECRET_REFERENCE), None),
    },
    checks=(_docker_auth_fields_match_method,),
)


@dataclass(frozen=True)
class Image:
    base_image: str = _text()
    docker_auth: dict[str, Any] | None = s.rule(s.nullable(DOCKER_AUTH), None)


# --- the job ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workspace:
    workspace_root: str | None = _text(None)
    external_dirs: list[str] = s.rule(_STR_LIST, default_factory=list)
    exclude_dirs: list[str] = s.rule(_STR_LIST, default_factory=list)


class SessionTrigger(str, enum.Enum):
    ON_STARTUP = "on_startup"
    ON_FAILURE = "on_failure"
    ON_DEMAND = "on_demand"


class SessionProvider(str, enum.Enum):
    VS_CODE = "vs_code"
    CURSOR = "cursor"
    SSH = "ssh"


class SessionAuthProvider(str, enum.Enum):
    GITHUB = "github"
    MICROSOFT = "microsoft"


@dataclass(frozen=True)
class InteractiveSession:
    trigger: SessionTrigger = s.rule(s.choice(SessionTrigger), SessionTrigger.ON_DEMAND)
    timeout_minutes: int = s.rule(s.integer(), 8 * 60)
    session_provider: SessionProvider = s.rule(s.choice(SessionProvider), SessionProvider.VS_CODE)
    auth_provider: SessionAuthProvider = s.rule(
        s.choice(SessionAuthProvider), SessionAuthProvider.MICROSOFT
    )


@dataclass(frozen=True)
class TrainingJob:
    """One training job: image, compute, runtime and BDN weights."""

    image: Image = s.rule(s.schema_for(Image))
    compute: Compute = s.rule(s.schema_for(Compute), default_factory=Compute)
    runtime: Runtime = s.rule(RUNTIME, default_factory=Runtime)
    interactive_session: InteractiveSession | None = s.rule(
        s.nullable(s.schema_for(InteractiveSession)), None
    )
    name: str | None = _text(None)
    priority: int | None = s.rule(s.nullable(s.integer()), None)
    workspace: Workspace | None = s.rule(s.nullable(s.schema_for(Workspace)), None)
    weights: list[WeightsSource] = s.rule(s.list_of(WEIGHTS_SOURCE), default_factory=list)
    enable_baseten_workdir: bool = s.rule(s.boolean(), True)


TRAINING_JOB: s.ObjectSchema[TrainingJob] = s.schema_for(TrainingJob)
