"""Open a store or a weights source from its URL; each backend's SDK is imported only here."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from bt_agent.errors import UsageError
from bt_agent.settings import Environ
from bt_agent.spec.urls import shown_url, unreadable_url
from bt_agent.storage.base import ObjectStore
from bt_agent.storage.credentials import (
    EMULATOR_KEY,
    EMULATOR_URL,
    AwsRole,
    AzureCredentials,
    S3Keys,
    account_key,
    azure_connection_string,
    azure_credentials,
    gcs_service_account,
    s3_keys,
)
from bt_agent.storage.file import FileStore

if TYPE_CHECKING:
    from bt_agent.storage.engine import Proxies

R2_ENDPOINT = "https://{account}.r2.cloudflarestorage.com"
R2_ENDPOINT_VARIABLE = "BT_R2_ENDPOINT_URL"  # overrides the endpoint (a jurisdiction's, tests)
#: Where a bucket of one of R2's jurisdictions is, which the account's endpoint does not hold.
R2_JURISDICTIONS_HINT = (
    "; a bucket in one of R2's jurisdictions (eu, fedramp, us) is at an endpoint of its own: set "
    f"{R2_ENDPOINT_VARIABLE}=https://{{account}}.<jurisdiction>.r2.cloudflarestorage.com"
)
CW_ENDPOINT = "https://cwobject.com"  # CoreWeave AI Object Storage, from anywhere
CW_ENDPOINT_VARIABLE = "BT_CW_ENDPOINT_URL"  # another: http://cwlota.com inside CoreWeave
CA_BUNDLE_VARIABLE = "AWS_CA_BUNDLE"  # a PEM file of CAs trusted beside the system's
#: The same for ``azure://`` and ``https://``: OpenSSL's variable (Go's tools read it too, as
#: azcopy does), then requests' (where Azure's CLI and Python SDK are told of a private CA).
CA_FILE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
DATASETS = "datasets"  # hf://datasets/owner/name: a dataset, as huggingface_hub names one
#: The variables of the region: botocore's, then the one the AWS CLI v2 and AWS's other SDKs
#: read (set in AWS's containers); where neither is set, the profile's is read.
REGION_VARIABLES = ("AWS_DEFAULT_REGION", "AWS_REGION")
#: The schemes of the stores that go through the object-store engine (gs:// stays on
#: google-cloud-storage, hf:// on huggingface_hub; https:// sources go through it too).
ENGINE_SCHEMES = ("s3://", "r2://", "cw://", "azure://")


def open_store(
    url: str,
    environ: Environ | None = None,
    secret: str | None = None,
    secret_name: str = "",
    role: AwsRole | None = None,
) -> ObjectStore:
    """The store or source behind ``url``: ``file://``, ``s3://``, ``r2://``, ``cw://``,
    ``gs://``, ``azure://``, ``hf://`` (read-only), ``http(s)://`` (read-only). ``secret`` is the
    content of the secret the spec names, in the format of REFERENCE.md §5; ``role``, an IAM
    role the spec names for an ``s3://`` source."""
    environ = environ or Environ.current()
    if (why := unreadable_url(url)) is not None:
        raise UsageError(f"invalid URL: {url!r} {why}")
    parsed = urlparse(url)
    scheme = parsed.scheme
    if role is not None and scheme != "s3":
        raise UsageError(
            f"{shown_url(url)}: auth_method {role.method} assumes an AWS IAM role, which only "
            "s3:// sources take; give this source's credentials in a secret "
            "(auth_method CUSTOM_SECRET, auth_secret_name)"
        )
    if scheme == "file":
        return FileStore(unquote(parsed.path))
    if scheme == "s3":
        from bt_agent.storage.s3 import S3Store

        keys = s3_keys(secret, secret_name) if secret is not None else _environment_keys(environ)
        return S3Store(
            parsed.netloc,
            parsed.path,
            keys=keys,
            region=_region(environ, keys),
            endpoint_url=_s3_endpoint(environ),
            ca_bundle=environ.get(CA_BUNDLE_VARIABLE),
            proxies=_proxies(environ),
            fips=_flag(environ, "AWS_USE_FIPS_ENDPOINT"),
            dualstack=_flag(environ, "AWS_USE_DUALSTACK_ENDPOINT"),
            shared_config=_shared_config(environ),
            role=role,
        )
    if scheme == "r2":
        return _r2(url, environ, secret, secret_name)
    if scheme == "cw":
        return _coreweave(url, environ, secret, secret_name)
    if scheme == "azure":
        return _azure(url, environ, secret, secret_name)
    if scheme == "gs":
        from bt_agent.storage.gcs import GCSStore

        account = gcs_service_account(secret, secret_name) if secret is not None else None
        return GCSStore(
            parsed.netloc,
            parsed.path,
            service_account=account,
            secret_name=secret_name,
            emulator_host=environ.get("STORAGE_EMULATOR_HOST"),
        )
    if scheme == "hf":
        from bt_agent.storage.hf import HFStore

        repo, _, revision = (parsed.netloc + parsed.path).partition("@")
        kind, _, named = repo.strip("/").partition("/")
        dataset = kind == DATASETS and named.count("/") == 1  # not a model's owner "datasets"
        return HFStore(
            named if dataset else repo.strip("/"),
            revision or "main",
            repo_type="dataset" if dataset else "model",
            token=secret,
            endpoint=environ.get("HF_ENDPOINT"),
            secret_name=secret_name,
        )
    if scheme in ("http", "https"):
        from bt_agent.storage.web import HTTPStore

        ca_bundle, ca_variable = _ca_file(environ)
        return HTTPStore(
            url,
            ca_bundle=ca_bundle,
            proxies=_proxies(environ),
            ca_variable=ca_variable,
            token=secret,
            secret_name=secret_name,
        )
    raise UsageError(
        f"unsupported URL {url!r}: use file://, s3://, r2://, cw://, gs://, azure://, hf:// or "
        "https://"
    )


def _r2(url: str, environ: Environ, secret: str | None, secret_name: str) -> ObjectStore:
    from bt_agent.storage.s3 import S3Store

    parsed = urlparse(url)
    account, dot, bucket = parsed.netloc.partition(".")
    if not dot or not account or not bucket:
        raise UsageError(f"invalid R2 URL {url!r}: use r2://<account_id>.<bucket>/path")
    given = environ.get(R2_ENDPOINT_VARIABLE)
    hint = "" if given else R2_JURISDICTIONS_HINT.format(account=account)
    keys = s3_keys(secret, secret_name) if secret is not None else _environment_keys(environ)
    return S3Store(
        bucket,
        parsed.path,
        url=url.rstrip("/"),
        keys=keys,
        endpoint_url=given or R2_ENDPOINT.format(account=account),
        region="auto",
        ca_bundle=environ.get(CA_BUNDLE_VARIABLE),
        proxies=_proxies(environ),
        missing_hint=hint,
    )


def _coreweave(url: str, environ: Environ, secret: str | None, secret_name: str) -> ObjectStore:
    """CoreWeave AI Object Storage: S3's API, buckets named in the host only (virtual-hosted
    style), at ``https://cwobject.com``; ``BT_CW_ENDPOINT_URL`` names another endpoint (inside
    CoreWeave, LOTA's ``http://cwlota.com``)."""
    from bt_agent.storage.s3 import S3Store

    parsed = urlparse(url)
    if not parsed.netloc:
        raise UsageError(f"invalid CoreWeave URL {url!r}: use cw://<bucket>/path")
    keys = s3_keys(secret, secret_name) if secret is not None else _environment_keys(environ)
    return S3Store(
        parsed.netloc,
        parsed.path,
        url=url.rstrip("/"),
        keys=keys,
        endpoint_url=environ.get(CW_ENDPOINT_VARIABLE) or CW_ENDPOINT,
        region=_region(environ, keys),
        ca_bundle=environ.get(CA_BUNDLE_VARIABLE),
        proxies=_proxies(environ),
        virtual_hosted=True,
    )


def _azure(url: str, environ: Environ, secret: str | None, secret_name: str) -> ObjectStore:
    from bt_agent.storage.azure import AzureStore

    parsed = urlparse(url)
    container, _, prefix = parsed.path.lstrip("/").partition("/")
    if not parsed.netloc or not container:
        raise UsageError(f"invalid Azure URL {url!r}: use azure://<account>/<container>/path")
    if secret is not None:
        credentials = azure_credentials(secret, secret_name, parsed.netloc)
    else:
        credentials = _azure_environment(environ, parsed.netloc)
    if not credentials.endpoint and _truthy(environ.get("AZURE_STORAGE_USE_EMULATOR")):
        credentials = _emulated(credentials, parsed.netloc, environ)
    ca_bundle, ca_variable = _ca_file(environ)
    return AzureStore(
        parsed.netloc,
        container,
        prefix,
        credentials=credentials,
        ca_bundle=ca_bundle,
        proxies=_proxies(environ),
        token_identity=_azure_identity(environ),
        ca_variable=ca_variable,
    )


def _ca_file(environ: Environ) -> tuple[str | None, str]:
    """The PEM file of CAs that ``azure://`` and ``https://`` trust beside the system's, and
    the variable that named it: the first of :data:`CA_FILE_VARIABLES` set (else the first,
    as errors name it)."""
    name = next((name for name in CA_FILE_VARIABLES if environ.get(name)), CA_FILE_VARIABLES[0])
    return environ.get(name), name


def _azure_identity(environ: Environ) -> str:
    """Whose token the engine asks for where it is given no credentials, as it chooses from
    the variables of Azure's identity library: a workload identity (AKS's), a service
    principal's secret, else the machine's managed identity."""
    if environ.get("AZURE_CLIENT_ID") and environ.get("AZURE_TENANT_ID"):
        if environ.get("AZURE_FEDERATED_TOKEN_FILE"):
            return "the workload identity of AZURE_CLIENT_ID and AZURE_FEDERATED_TOKEN_FILE"
        if environ.get("AZURE_CLIENT_SECRET"):
            return "the service principal of AZURE_CLIENT_ID and AZURE_CLIENT_SECRET"
    return "the machine's managed identity"


def _azure_environment(environ: Environ, account: str) -> AzureCredentials:
    """The standard variables of Azure's tools: the account key as the engine's own name
    (``AZURE_STORAGE_ACCOUNT_KEY``) or the Azure CLI's (``AZURE_STORAGE_KEY``) has it."""
    connection = environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection:
        return azure_connection_string(connection, "AZURE_STORAGE_CONNECTION_STRING", account)
    keys = [
        (name, environ.get(name)) for name in ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY")
    ]
    key = next((account_key(value, name) for name, value in keys if value), None)
    return AzureCredentials(key, (environ.get("AZURE_STORAGE_SAS_TOKEN") or "").lstrip("?") or None)


def _emulated(given: AzureCredentials, account: str, environ: Environ) -> AzureCredentials:
    """Azurite, as the engine's own variables name it (``AZURE_STORAGE_USE_EMULATOR``, with
    ``AZURITE_BLOB_STORAGE_URL`` for another address than its default): requests go to the
    account's path there, with the credentials given, else the emulator's published key."""
    address = (environ.get("AZURITE_BLOB_STORAGE_URL") or EMULATOR_URL).rstrip("/")
    key = given.account_key or (None if given.sas_token else EMULATOR_KEY)
    return AzureCredentials(key, given.sas_token, f"{address}/{account}")


def _truthy(value: str | None) -> bool:
    """A yes-or-no variable as the engine (object_store) reads it."""
    return (value or "").strip().lower() in ("1", "true", "on", "yes", "y")


def _environment_keys(environ: Environ) -> S3Keys | None:
    """The keys of the standard AWS variables, when both are set: what botocore's credential
    chain takes first too (before profiles and instance roles), read here so that a store
    opened with them needs no botocore."""
    key_id, secret_key = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not secret_key:
        return None
    return S3Keys(key_id, secret_key, session_token=environ.get("AWS_SESSION_TOKEN") or None)


def _region(environ: Environ, keys: S3Keys | None) -> str | None:
    """The region the secret's keys name, else the variables' (:data:`REGION_VARIABLES`)."""
    return (keys.region if keys else None) or _first_set(environ, REGION_VARIABLES)


def _s3_endpoint(environ: Environ) -> str | None:
    """S3's endpoint as the variables name it: AWS's names, then the engine's own
    (``AWS_ENDPOINT``), which it would otherwise read itself where none is given, sending its
    requests where the agent's other requests (a bucket's region, aborts) and errors do not go;
    none where ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` is true, as botocore reads it (the engine
    is then given AWS's endpoint, over any of its environment)."""
    if _flag(environ, "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        return None
    return _first_set(environ, ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))


def _first_set(environ: Environ, names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` that is set."""
    return next((value for name in names if (value := environ.get(name))), None)


def _shared_config(environ: Environ) -> str | None:
    """The path of AWS's shared config file, as botocore finds it: ``AWS_CONFIG_FILE``, else
    ``~/.aws/config`` (``~`` is the home directory in either)."""
    path, home = environ.get("AWS_CONFIG_FILE") or "~/.aws/config", environ.get("HOME")
    if path.startswith("~/"):
        return f"{home}{path[1:]}" if home else None
    return path


def _flag(environ: Environ, name: str) -> bool | None:
    """A yes-or-no variable as botocore reads it; None where it is unset."""
    value = environ.get(name)
    return None if value is None else value.strip().lower() == "true"


def _proxies(environ: Environ) -> Proxies:
    """The proxies of the standard variables (either case; ``ALL_PROXY`` for a scheme without
    its own), as curl and botocore read them."""
    from bt_agent.storage.engine import Proxies

    def first(*names: str) -> str | None:  # each name in either case
        return _first_set(environ, tuple(n for name in names for n in (name, name.lower())))

    return Proxies(
        https=first("HTTPS_PROXY", "ALL_PROXY"),
        http=first("HTTP_PROXY", "ALL_PROXY"),
        excludes=first("NO_PROXY"),
    )
