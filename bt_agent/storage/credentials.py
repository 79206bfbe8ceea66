"""Credentials for a weights source, from the secret named in the spec (REFERENCE.md §5).

HF: the token itself. S3 and R2: JSON ``{"aws_access_key_id", "aws_secret_access_key",
"aws_region"?, "aws_session_token"?}``. GCS: a service-account JSON. The store's own credentials
come from each SDK's standard environment instead. Values never appear in errors or ``repr``.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from bt_agent.errors import AccessDeniedError


@dataclass(frozen=True)
class S3Keys:
    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    region: str | None = None
    session_token: str | None = field(default=None, repr=False)


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


def azure_credentials(secret: str, name: str, account: str) -> AzureCredentials:
    """A connection string, a SAS token or an account key, as the Azure portal gives them, for
    the storage ``account``; the error names the secret, never its content."""
    text = secret.strip()
    if "AccountKey=" in text or "SharedAccessSignature=" in text:
        return azure_connection_string(text, f"secret {name!r}", account)
    if "sig=" in text and "=" in text.lstrip("?"):
        return AzureCredentials(sas_token=text.lstrip("?"))
    if not text:
        raise AccessDeniedError(
            f"secret {name!r} is empty; give the storage account's key, a SAS token or a "
            "connection string"
        )
    return AzureCredentials(account_key=account_key(text, f"secret {name!r}"))


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
    """The credentials and endpoint of a connection string for the storage ``account``: one
    of another account (its ``AccountName``) is an error naming both, as its key or token
    would be refused there."""
    fields: dict[str, str] = {}
    for part in text.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields[name] = value
    key, sas = fields.get("AccountKey"), fields.get("SharedAccessSignature")
    if not key and not sas:
        raise AccessDeniedError(
            f"{what} is a connection string with neither AccountKey nor SharedAccessSignature"
        )
    named = fields.get("AccountName")
    if named and named != account:
        raise AccessDeniedError(
            f"{what} is a connection string of the storage account {named!r}, not of "
            f"{account!r} (the URL's); give that account's, or name {named!r} in the URL"
        )
    return AzureCredentials(
        account_key(key, what) if key else None,
        sas.lstrip("?") if sas else None,
        fields.get("BlobEndpoint") or _blob_endpoint(fields),
    )


def _blob_endpoint(fields: dict[str, str]) -> str | None:
    """The blob endpoint of a connection string that names its account's cloud by its
    ``EndpointSuffix`` (``core.chinacloudapi.cn``, ``core.usgovcloudapi.net``), as Azure's SDKs
    make it; None where it does not."""
    account, suffix = fields.get("AccountName"), fields.get("EndpointSuffix")
    if not account or not suffix:
        return None
    return f"{fields.get('DefaultEndpointsProtocol') or 'https'}://{account}.blob.{suffix}"
