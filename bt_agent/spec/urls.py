"""The URLs of weights sources and stores that no store can read, told apart before any is
opened: the engine of object stores panics on some, and urllib raises on others."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

CLOUD_SCHEMES = ("s3://", "gs://", "azure://", "r2://", "cw://")
#: What names a bucket (an Azure account, a container): whitespace or a URL's reserved
#: characters there reach no store.
BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
BUCKET_RULE = "only letters, digits, '.', '-' and '_'"
#: A control character, which no object's name can hold.
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SPACE = re.compile(r"\s")
#: What a URL's hidden parts are shown as (``bt_agent.secrets.MASK``: secret values' too).
HIDDEN = "***"


def unreadable_url(url: str) -> str | None:
    """Why no store can read ``url``, where that is so: an object store's bucket (an Azure
    account or container) named as none can be, a path with a ``.`` or ``..`` segment or a
    control character, which no object's name can hold, or an ``https://`` URL of no host."""
    scheme, _, rest = url.partition("://")
    if scheme == "https":
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            host = None
        return None if host and not _SPACE.search(url) else "is no URL of a host"
    if f"{scheme}://" not in CLOUD_SCHEMES:
        return None
    host, _, path = rest.partition("/")
    names = [host, path.partition("/")[0]] if scheme == "azure" else [host]
    if misnamed := next((name for name in names if name and not BUCKET_NAME.match(name)), None):
        return f"names {misnamed!r}, which no bucket can be named ({BUCKET_RULE})"
    if {".", ".."} & set(path.split("/")):
        return "has a '.' or '..' segment in its path, which no object's name can hold"
    if control := CONTROL.search(path):
        return f"has a control character ({control.group(0)!r}) in its path"
    return None


def shown_url(url: str) -> str:
    """``url`` as logs and errors show it: the values of an ``http(s)://`` URL's query (a
    presigned URL's signature and credential) and its password hidden, the names kept."""
    if not url.startswith(("https://", "http://")):
        return url
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url.partition("?")[0]
    netloc = parts.netloc.replace(f":{password}@", f":{HIDDEN}@") if password else parts.netloc
    names = [field.partition("=")[0] for field in parts.query.split("&") if field]
    query = "&".join(f"{name}={HIDDEN}" for name in names)
    return parts._replace(netloc=netloc, query=query).geturl()


def shown_spec(wire: dict[str, Any]) -> dict[str, Any]:
    """``wire`` (a TrainingJob as given) as the job's record keeps it: each weights source as
    :func:`shown_url` shows it (a presigned URL's signature grants access until it expires, and
    the record outlives the job)."""
    weights = wire.get("weights")
    if not isinstance(weights, list):
        return wire
    shown = [
        {**source, "source": shown_url(source["source"])}
        if isinstance(source, dict) and isinstance(source.get("source"), str)
        else source
        for source in weights
    ]
    return {**wire, "weights": shown}
