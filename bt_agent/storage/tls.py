"""The errors of connections made by clients on the standard library's ``socket`` and ``ssl``
(the Hugging Face Hub's, Google Cloud Storage's, botocore's): a certificate refused, a server
that speaks no TLS, or a host name that does not exist, told apart from outages (a clear error
at once, never a wait); and of an outage, the system's own words for it.
"""

from __future__ import annotations

import socket
import ssl
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

from bt_agent.errors import StoreError
from bt_agent.storage.refusals import (
    Refusal,
    handshake_refused,
    no_such_host,
    speaks_no_tls,
    untrusted_certificate,
)

#: OpenSSL's verification errors (``X509_V_ERR_*``) that another CA would not mend.
_CERTIFICATE_KINDS: dict[int, Refusal] = {
    9: "expired",
    10: "expired",
    62: "other-host",
    64: "other-host",
}
#: What OpenSSL says of a first answer that is no TLS record (3.0 and 3.1; 3.2 and later).
_NOT_TLS = ("wrong version number", "record layer failure")


def tls_error(
    exc: BaseException, uri: str, url: str = "", variable: str = "SSL_CERT_FILE"
) -> StoreError | None:
    """The error for a TLS connection to ``url`` (by default ``uri``) that no wait would mend,
    where ``exc`` or what caused it says so: a certificate refused (what to do: ``variable``
    trusts another CA in the client that refused it), a server that speaks no TLS there, or
    one that ends the handshake with an alert no wait mends (a client certificate asked for)."""
    found = _ssl_cause(exc)
    if found is None:
        return None
    where = f"https://{urlsplit(url or uri).netloc}"
    if isinstance(found, ssl.SSLCertVerificationError):
        kind = _CERTIFICATE_KINDS.get(found.verify_code, "untrusted")
        said = found.verify_message.rstrip(".")
        return StoreError(f"{uri}: {untrusted_certificate(where, kind, said, variable)}", uri)
    said = str(found.reason or found).lower().replace("_", " ")
    if any(words in said for words in _NOT_TLS):
        return StoreError(f"{uri}: {speaks_no_tls(where, said)}", uri)
    alert = str(found.reason or "").partition("_ALERT_")[2]  # TLSV13_ALERT_CERTIFICATE_REQUIRED
    if alert and (refused := handshake_refused(where, alert)):
        return StoreError(f"{uri}: {refused}", uri)
    return None


#: The resolver's answers for a host name that does not exist (``getaddrinfo``'s; glibc's
#: ``EAI_NODATA``: a name without an address). ``EAI_AGAIN``, a resolver that fails for the
#: moment, is an outage.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def unknown_host(exc: BaseException, url: str) -> str | None:
    """What to do where ``exc``, or what caused it, is the resolver's answer that the host of a
    request to ``url`` does not exist (the proxy's, where the environment sends it through
    one); else None."""
    found = next((e for e in _causes(exc) if isinstance(e, socket.gaierror)), None)
    if found is None or found.errno not in _NO_SUCH_NAME:
        return None
    host, said = urlsplit(url).hostname or url, found.strerror or str(found)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(urlsplit(url).scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        return no_such_host(urlsplit(proxy).hostname or proxy, said, proxy=True)
    return no_such_host(host, said)


def has_no_name(host: str) -> bool:
    """Whether the resolver says that ``host`` does not exist (asked once more)."""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        return exc.errno in _NO_SUCH_NAME
    return False


def connection_cause(exc: BaseException) -> str:
    """Why a connection failed, in the system's words where ``exc`` or what caused it holds
    them (``Connection refused``, ``Name or service not known``), else ``exc``'s type."""
    for found in _causes(exc):
        if isinstance(found, OSError) and found.strerror:
            return found.strerror
    return type(exc).__name__


def _ssl_cause(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error that ``exc`` is, or that caused it, if any."""
    return next((found for found in _causes(exc) if isinstance(found, ssl.SSLError)), None)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it, in turn: the ``reason`` of urllib's ``URLError`` and
    urllib3's ``MaxRetryError``, else an exception it holds (urllib3's ``SSLError`` holds the
    standard library's), else the exception it was raised from or while handling."""
    found: BaseException | None = exc
    seen: set[int] = set()  # a chain of causes that turns back on itself ends there
    while found is not None and id(found) not in seen:
        yield found
        seen.add(id(found))
        reason = getattr(found, "reason", None)
        held = next((given for given in found.args if isinstance(given, BaseException)), None)
        if isinstance(reason, BaseException):
            found = reason
        else:
            found = held or found.__cause__ or found.__context__
