"""The engine's errors as the agent's typed errors (:mod:`bt_agent.errors`).

The engine reports a failure as text: the service's status, code and words, the connection's
cause, rustls' reason for a certificate it refused, a credential provider's own error. It is read
here, once for every store on the engine: what no retry mends (a container that is not there,
credentials refused, a certificate not trusted, a handshake refused, an object archived, a name
the engine cannot read, a host name that does not exist) is said at once with what to do; what
may pass (a 5xx, throttling, no answer at all) is a :class:`TransientStoreError`, which the
callers above wait out.
"""

from __future__ import annotations

import re
from typing import Protocol
from urllib.parse import urlsplit

from bt_agent.errors import (
    AccessDeniedError,
    ChangedError,
    IntegrityError,
    NotFoundError,
    StoreError,
    TransientStoreError,
)
from bt_agent.spec.urls import CONTROL
from bt_agent.storage.refusals import (
    Refusal,
    handshake_refused,
    no_such_host,
    speaks_no_tls,
    speaks_tls,
    untrusted_certificate,
)

_CORRUPT = re.compile(
    r"BadDigest|InvalidDigest|XAmzContentSHA256Mismatch|InvalidChecksum|Md5Mismatch"
)
_CERTIFICATE = re.compile(r"certificate|UnknownIssuer|CertNotValid|NotValidForName", re.I)
#: A TLS alert the server ended the handshake with, as rustls names it.
_ALERT = re.compile(r"AlertReceived\(\s*(\w+)")
#: rustls' word for a first answer that is no TLS record (a server of plain HTTP, most often).
_NOT_TLS = re.compile(r"InvalidMessage\(\s*InvalidContentType")
#: A server of TLS answering a request of plain HTTP (Go's net/http; nginx).
_TLS_ONLY = re.compile(
    r"(?:Client sent an )?HTTP request to an HTTPS server"
    r"|(?:The )?plain HTTP request was sent to HTTPS port"
)
#: How a server of TLS only may meet a request of plain HTTP without saying why: the connection
#: cut while a write's body is sent (Go's servers), or a 400 without a body (a HEAD's).
_CUT = re.compile(r"reset by peer|connection closed|IncompleteMessage|Broken pipe", re.I)
#: Seconds the handshake that tells a server of TLS may take.
TLS_PROBE_SECONDS = 3.0
_STATUS = re.compile(r"status code: (\d{3})")
#: S3's answer to a request signed for a region other than the bucket's: a redirect without a
#: place to go (the engine's words), or its error code.
_OTHER_REGION = re.compile(r"redirect without LOCATION|the region '[^']*' is wrong")
_REGION = re.compile(r"(?:expecting '|<Region>)([\w-]+)")
#: Why a connection failed, in the words of the system or the resolver, as the engine's report
#: quotes them (its first line only says "error sending request").
_CAUSE = re.compile(r'(?:message|error): "([^"]+)"')
#: The URL of the request the engine reports on (a token's: its query left out where shown).
_ASKED = re.compile(r"Error performing [A-Z]+ (\S+) in ")
#: The resolver's answer for a host name that does not exist (glibc's, musl's and macOS'
#: ``EAI_NONAME``; glibc's ``EAI_NODATA``, a name without an address), as the engine quotes it;
#: a resolver that fails for the moment (``Temporary failure in name resolution``) is an outage.
_NO_SUCH_NAME = re.compile(
    r"failed to lookup address information: (Name or service not known|No address associated "
    r"with hostname|Name does not resolve|nodename nor servname provided, or not known)"
)
#: A credential provider of ours that failed (botocore's chain: no credentials, an SSO session
#: expired, a credential_process that failed; a role STS would not give, or could not be
#: reached for), as the engine reports it.
_PROVIDER_FAILED = re.compile(r"credential provider: (\w+): ([^\n]+)")
_NO_CONTAINER = re.compile(r"<Code>(NoSuchBucket|ContainerNotFound)</Code>")
#: An object in an archive (S3's Glacier classes, Azure's archive tier): read once restored.
_ARCHIVED = re.compile(r"<Code>(InvalidObjectState|BlobArchived)</Code>")
#: The service's own code and words for what it refused (the XML errors of S3 and Azure; the
#: words' first line: Azure's go on with a request id and a time).
_SERVICE_SAID = re.compile(r"<Code>([^<]+)</Code>\s*<Message>([^<\n]*)")
#: An object whose name the engine cannot take (a control character, an empty segment).
_UNREADABLE_NAME = re.compile(r'Error parsing Path "(.*?)": ([^\n]*)', re.S)
_RETRYABLE = re.compile(r"SlowDown|RequestTimeout|InternalError|ServiceUnavailable|Throttl|Busy")


class ErrorContext(Protocol):
    """What the errors of a store's engine are said with: its endpoint, its container, where
    its credentials come from, and how its requests go (an :class:`EngineStore`)."""

    endpoint_url: str | None
    container_noun: str
    missing_hint: str
    archived_hint: str
    token_identity: str
    credentials_hint: str
    ca_variable: str

    @property
    def plain_http(self) -> bool: ...
    def uri(self, key: str = "") -> str: ...
    def own_endpoint(self) -> str: ...
    def access_hint(self) -> str: ...
    def other_region(self, region: str | None) -> str: ...
    def changed(self, key: str, pinned: str = "", now: str = "") -> ChangedError: ...
    def route(self, where: str) -> str: ...
    def looked_up(self, asked: str) -> tuple[str, bool]: ...
    def takes_tls_only(self) -> bool: ...


def typed_error(store: ErrorContext, exc: Exception, key: str) -> Exception:
    """The typed error for one of the engine's about ``key`` in ``store``."""
    from obstore import exceptions as engine

    if isinstance(exc, StoreError):
        return exc
    uri = store.uri(key)
    text = str(exc)
    detail = first_line(text)
    status = _STATUS.search(text)
    code = status.group(1) if status else ""
    where = store.endpoint_url or store.own_endpoint()
    if _NO_CONTAINER.search(text):  # not an object missing: nothing can be read or written
        return StoreError(
            f"{uri}: the {store.container_noun} of {store.uri()} does not exist; check its "
            f"name and where requests go ({where}){store.missing_hint}",
            uri,
        )
    if unreadable := _UNREADABLE_NAME.search(text):  # in a listing: no retry can read it
        name, why = unreadable.groups()
        why = CONTROL.sub(lambda found: repr(found.group(0)).strip("'"), why)
        return StoreError(
            f"{uri}: the engine cannot read the name of the object {name!r} there ({why}); "
            f"rename it, or move it from under {store.uri()}",
            uri,
        )
    if isinstance(exc, FileNotFoundError | engine.NotFoundError) or code == "404":
        return NotFoundError(
            f"{uri} does not exist; check the {store.container_noun} and the path", uri
        )
    if _ARCHIVED.search(text):  # neither a retry nor other credentials read it
        return StoreError(
            f"{uri}: the object is archived ({_said(text)}); {store.archived_hint}", uri
        )
    if "Error performing token request" in text:  # the identity's, of no use here
        asked, causes = _ASKED.search(text), _CAUSE.findall(text)
        if asked and causes:  # its endpoint out of reach (the metadata service's, most often)
            detail = f"cannot reach {asked.group(1).partition('?')[0]}: {causes[-1]}"
        return AccessDeniedError(
            f"{uri}: no credentials: {store.token_identity} gave none ({detail}); "
            f"{store.credentials_hint}",
            uri,
        )
    if provider := _PROVIDER_FAILED.search(text):  # the credentials, not the service
        name, said = provider.groups()
        if name == "TransientStoreError":  # STS out of reach: asked again
            return TransientStoreError(said, uri)
        own = said if name == "AccessDeniedError" else f"{uri}: {name}: {said}"
        return AccessDeniedError(own, uri)
    if isinstance(exc, engine.PermissionDeniedError | engine.UnauthenticatedError) or code in (
        "401",
        "403",
    ):
        why = f" {said}" if (said := _said(text)) else ""
        return AccessDeniedError(
            f"{uri}: access denied ({code or 'forbidden'}{why}); {store.access_hint()}"
            f"{store.missing_hint}",
            uri,
        )
    if isinstance(exc, engine.PreconditionError):  # If-Match: another version is there
        return store.changed(key)
    if not isinstance(exc, engine.BaseError):
        return exc
    if _OTHER_REGION.search(text):
        named = _REGION.search(text)
        return StoreError(f"{uri}: {store.other_region(named and named.group(1))}", uri)
    if _CORRUPT.search(text):
        return IntegrityError(f"{uri}: the service rejected the checksum ({detail})", uri)
    if (alert := _ALERT.search(text)) and (refused := handshake_refused(where, alert.group(1))):
        return StoreError(f"{uri}: {refused}", uri)  # before the certificate's: its names say so
    if _CERTIFICATE.search(text):
        return StoreError(f"{uri}: {_untrusted(store, where, _tls_reason(text))}", uri)
    if _NOT_TLS.search(text):
        return StoreError(f"{uri}: {speaks_no_tls(where, 'invalid content type')}", uri)
    if store.plain_http and (asked := _TLS_ONLY.search(text)):
        return StoreError(f"{uri}: {speaks_tls(where, asked.group(0))}", uri)
    if not code and (unknown := _NO_SUCH_NAME.search(text)):  # a name mistyped: said at once
        asked = _ASKED.search(text)
        host, proxy = store.looked_up(asked.group(1) if asked else where)
        return StoreError(f"{uri}: {no_such_host(host, unknown.group(1), proxy)}", uri)
    said = (_CAUSE.findall(text) or [detail])[-1] if not code else f"{code} without a reason"
    if (code == "400" or (not code and _CUT.search(text))) and store.takes_tls_only():
        return StoreError(
            f"{uri}: {speaks_tls(where, f'{said}; a TLS handshake with it succeeds')}", uri
        )
    if code.startswith("5") or code == "429" or _RETRYABLE.search(text):
        return TransientStoreError(f"{uri}: {code or 'retryable'}: {detail}", uri)
    if not code:  # no answer at all: connection refused, reset, timed out, no resolver
        return TransientStoreError(f"{uri}: cannot reach {store.route(where)} ({said})", uri)
    if said_so := _said(text):  # the service's words rather than its XML
        return StoreError(f"{uri}: the service refused the request ({code} {said_so})", uri)
    return StoreError(f"{uri}: {detail}", uri)


def _untrusted(store: ErrorContext, where: str, reason: str) -> str:
    """Why the certificate of ``where`` was refused (rustls' ``reason``), and what to do."""
    kind: Refusal = (
        "expired"
        if reason.startswith(("Expired", "NotValidYet"))
        else "other-host"
        if reason.startswith("NotValidForName")
        else "untrusted"
    )
    return untrusted_certificate(where, kind, reason, store.ca_variable)


def answers_tls(endpoint: str) -> bool:
    """Whether the server of ``endpoint`` completes a TLS handshake (its certificate unchecked:
    nothing is sent over the connection), or answers it with a TLS alert."""
    import socket
    import ssl

    parts = urlsplit(endpoint)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    address = (parts.hostname or "", parts.port or 80)
    try:
        with (
            socket.create_connection(address, timeout=TLS_PROBE_SECONDS) as connection,
            context.wrap_socket(connection, server_hostname=parts.hostname),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "")  # it spoke TLS, refusing something of ours
    except OSError:  # refused, reset, timed out: no server of TLS there
        return False


def _said(text: str) -> str:
    """The service's code and words for what it refused (``Code: message``), where its answer
    gives them; else nothing."""
    found = _SERVICE_SAID.search(text)
    return f"{found.group(1)}: {found.group(2).strip()}" if found else ""


def first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.split(" - ", 1)[-1].strip().rstrip(":")


def _tls_reason(text: str) -> str:
    found = re.search(r"InvalidCertificate\(\s*(\w+)", text)
    return found.group(1) if found else "certificate verification failed"
