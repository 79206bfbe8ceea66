"""Credentials for a weights source, from the secret named in the spec (REFERENCE.md §5).

HF: the token itself. S3 and R2: JSON ``{"aws_access_key_id", "aws_secret_access_key",
"aws_region"?, "aws_session_token"?}``, or an IAM role the spec names (:class:`AwsRole`). GCS: a
service-account JSON. Azure: a connection string, a SAS token or the account key. https: a token
(:mod:`web`). The store's own credentials come from each SDK's standard environment instead. Values
never appear in errors or ``repr``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bt_agent.errors import AccessDeniedError


@dataclass(frozen=True)
class S3Keys:
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    region: str | None = None
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AwsRole:
    """An IAM role to assume for an ``s3://`` source, as the spec's ``auth`` names it:
    ``AWS_ASSUME_ROLE`` with the credentials found otherwise (a secret's keys, the environment's,
    botocore's chain), ``AWS_OIDC`` with the web identity token in ``token_file``
    (``AWS_WEB_IDENTITY_TOKEN_FILE``). ``region``: where STS is asked (the bucket's is found as for
    any source); ``session_name``: what the role's sessions are called in AWS's logs
    (CloudTrail)."""

    arn: str
    region: str | None = None
    method: str = "AWS_ASSUME_ROLE"
    session_name: str = "bt-agent"
    token_file: str | None = None

    @property
    def web_identity(self) -> bool:
        return self.method == "AWS_OIDC"


def _json_object(secret: str, what: str, name: str) -> dict[str, Any]:
    try:
        data = json.loads(secret)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise AccessDeniedError(f"secret {name!r} is not a JSON object; {what}")
    return data


def s3_keys(secret: str, name: str) -> S3Keys:
    """Parse an S3/R2 credentials secret; the error names the secret, never its content."""
    how = (
        'give {"aws_access_key_id": ..., "aws_secret_access_key": ...} '
        '(optionally "aws_region", "aws_session_token")'
    )
    data = _json_object(secret, how, name)
    key_id, secret_key = data.get("aws_access_key_id"), data.get("aws_secret_access_key")
    if not isinstance(key_id, str) or not isinstance(secret_key, str):
        raise AccessDeniedError(
            f"secret {name!r} lacks aws_access_key_id or aws_secret_access_key; {how}"
        )
    region, token = data.get("aws_region"), data.get("aws_session_token")
    return S3Keys(
        key_id,
        secret_key,
        region if isinstance(region, str) else None,
        token if isinstance(token, str) else None,
    )


def gcs_service_account(secret: str, name: str) -> dict[str, Any]:
    return _json_object(secret, "give the service account's JSON key file as the secret", name)


@dataclass(frozen=True)
class AzureCredentials:
    """What reaches an Azure storage account: its key or a SAS token, and the blob endpoint
    where a connection string names it (its ``BlobEndpoint``, as Azurite's, or its account in
    the ``EndpointSuffix`` of another cloud than Azure's global one)."""

    account_key: str | None = field(default=None, repr=False)
    sas_token: str | None = field(default=None, repr=False)
    endpoint: str | None = None


#: Azurite's address (and the older Storage Emulator's), where the engine's
#: ``AZURE_STORAGE_USE_EMULATOR`` sends requests unless ``AZURITE_BLOB_STORAGE_URL`` names another.
EMULATOR_URL = "http://127.0.0.1:10000"
#: The emulators' development account and its key, published by Microsoft: the same in each.
EMULATOR_ACCOUNT = "devstoreaccount1"
EMULATOR_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: The fields that make a text a connection string rather than a key or a SAS token.
_CONNECTION_FIELDS = {"accountkey", "sharedaccesssignature", "usedevelopmentstorage"}


def azure_credentials(secret: str, name: str, account: str) -> AzureCredentials:
    """A connection string, a SAS token (or the URL that carries one) or an account key, as the
    Azure portal gives them, for the storage ``account``; the error names the secret, never
    its content."""
    text = secret.strip()
    if _connection_fields(text).keys() & _CONNECTION_FIELDS:
        return azure_connection_string(text, f"secret {name!r}", account)
    if text.startswith(("https://", "http://")):
        return _sas_url(text, f"secret {name!r}", account)
    if "sig=" in text and "=" in text.lstrip("?"):
        return AzureCredentials(sas_token=text.lstrip("?"))
    if not text:
        raise AccessDeniedError(
            f"secret {name!r} is empty; give the storage account's key, a SAS token or a "
            "connection string"
        )
    return AzureCredentials(account_key=account_key(text, f"secret {name!r}"))


def _sas_url(text: str, what: str, account: str) -> AzureCredentials:
    """A SAS URL (the portal's "Blob SAS URL", next to the token): its query is the token, and
    where it points the endpoint: the account's host (``<account>[.privatelink].blob.<cloud>``),
    the host and the account's path (an emulator's, Azurite's), or a domain of the account's
    own. One of another account is an error naming both."""
    parts = urlsplit(text)
    if "sig=" not in parts.query:
        raise AccessDeniedError(
            f"{what} is a URL that carries no SAS token (no sig= in its query); give the Blob "
            "SAS URL or token, as the Azure portal shows them"
        )
    host, first = parts.hostname or "", parts.path.strip("/").partition("/")[0]
    if ".blob." in host:
        named, path = host.partition(".")[0], ""
    elif first == account:  # an emulator's: the account in the path
        named, path = first, f"/{first}"
    else:  # a domain of the account's own, which names none
        named, path = account, ""
    if named != account:
        raise AccessDeniedError(
            f"{what} is a SAS URL of the storage account {named!r}, not of {account!r} (the "
            f"URL's); give that account's, or name {named!r} in the URL"
        )
    return AzureCredentials(
        sas_token=parts.query, endpoint=f"{parts.scheme}://{parts.netloc}{path}"
    )


def account_key(text: str, what: str) -> str:
    """``text`` where it can be an Azure storage account's key (base64, as the portal shows it);
    else an error naming ``what`` held it, never the text."""
    try:
        base64.b64decode(text, validate=True)
    except ValueError:
        raise AccessDeniedError(
            f"{what} is neither a storage account key (base64), a SAS token (with sig=) nor a "
            "connection string (with AccountKey= or SharedAccessSignature=); give one of those, "
            "as the Azure portal shows it"
        ) from None
    return text


def azure_connection_string(text: str, what: str, account: str) -> AzureCredentials:
    """The credentials and endpoint of a connection string for the storage ``account`` (its
    fields' names in any case, as Azure's SDKs read them): one of another account (its
    ``AccountName``) is an error naming both, as its key or token would be refused there.
    ``UseDevelopmentStorage=true`` is the emulator's development account, at its address
    (or its ``DevelopmentStorageProxyUri``'s host)."""
    fields = _connection_fields(text)
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        host = fields.get("developmentstorageproxyuri", EMULATOR_URL.rpartition(":")[0])
        fields = {
            "accountname": EMULATOR_ACCOUNT,
            "accountkey": EMULATOR_KEY,
            "blobendpoint": f"{host.rstrip('/')}:10000/{EMULATOR_ACCOUNT}",
        }
    key, sas = fields.get("accountkey"), fields.get("sharedaccesssignature")
    if not key and not sas:
        raise AccessDeniedError(
            f"{what} is a connection string with neither AccountKey nor SharedAccessSignature"
        )
    named = fields.get("accountname")
    if named and named != account:
        raise AccessDeniedError(
            f"{what} is a connection string of the storage account {named!r}, not of "
            f"{account!r} (the URL's); give that account's, or name {named!r} in the URL"
        )
    return AzureCredentials(
        account_key(key, what) if key else None,
        sas.lstrip("?") if sas else None,
        fields.get("blobendpoint") or _blob_endpoint(fields),
    )


def _connection_fields(text: str) -> dict[str, str]:
    """A connection string's fields (``Name=value;...``), by their names in lower case."""
    fields: dict[str, str] = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name.lower()] = value
    return fields


def _blob_endpoint(fields: dict[str, str]) -> str | None:
    """The blob endpoint of a connection string that names its account, as Azure's SDKs make
    it: in the cloud of its ``EndpointSuffix`` (``core.chinacloudapi.cn``,
    ``core.usgovcloudapi.net``; else Azure's global one), over its ``DefaultEndpointsProtocol``
    (else https); None where it names no account."""
    account = fields.get("accountname")
    if not account:
        return None
    suffix = fields.get("endpointsuffix") or "core.windows.net"
    return f"{fields.get('defaultendpointsprotocol') or 'https'}://{account}.blob.{suffix}"
