"""What to say where a connection to a store fails in a way no wait mends: a TLS certificate
refused, a server that speaks no TLS (or only TLS), a handshake ended with an alert, a host name
that does not exist. Each says what to do; the clients' errors are read for them in
:mod:`engine_errors` (the engine's) and :mod:`tls` (the standard library's).
"""

from __future__ import annotations

from typing import Literal

#: Why a TLS certificate was refused: one another CA would not mend, or one it would.
Refusal = Literal["expired", "other-host", "untrusted"]


def untrusted_certificate(where: str, kind: Refusal, reason: str, variable: str) -> str:
    """Why the TLS certificate of ``where`` was refused and what to do: ``kind`` is ``expired``
    (or not valid yet), ``other-host`` (issued for another name) or ``untrusted`` (signed by a
    CA not trusted, which ``variable`` may name)."""
    if kind == "expired":
        return (
            f"the TLS certificate of {where} is not valid now ({reason}); the endpoint must "
            "renew it (or this machine's clock is wrong)"
        )
    if kind == "other-host":
        return (
            f"the TLS certificate of {where} is for another host name ({reason}); use the name "
            "the certificate was issued for in the URL"
        )
    return (
        f"the TLS certificate of {where} is not trusted ({reason}); set {variable} to the PEM "
        "file of the CA that signed it"
    )


def speaks_no_tls(where: str, reason: str) -> str:
    """What to do where ``where`` answered a TLS handshake with no TLS at all (``reason``, the
    client's words): most often a server of plain HTTP, named with ``https://``. No wait mends
    that, so it is said at once, with the URL to write instead."""
    plain = (
        f"; if it serves plain HTTP, write it as http://{where[8:]}"
        if where.startswith("https://")
        else ""
    )
    return f"{where} does not speak TLS (its answer is no TLS record: {reason}){plain}"


#: Why a server ends a TLS handshake with an alert no wait mends, by the alert's name (rustls'
#: word for it, lower case; OpenSSL's, its underscores left out).
_ALERTS = {
    "certificaterequired": "it asks for a client certificate, which the agent does not send",
    "badcertificate": "it asks for a client certificate, which the agent does not send",
    "handshakefailure": (
        "it asks for a client certificate (which the agent does not send), or shares no cipher "
        "with the agent"
    ),
    "protocolversion": "it speaks no TLS version the agent does (TLS 1.2 and 1.3)",
    "insufficientsecurity": "it takes no cipher the agent offers",
}


def handshake_refused(where: str, alert: str) -> str | None:
    """What to say where the server of ``where`` ended the TLS handshake with ``alert`` (its
    name, rustls' ``CertificateRequired`` or OpenSSL's ``CERTIFICATE_REQUIRED``), where no wait
    mends it: it asks for a client certificate, or shares no TLS version or cipher with the
    agent (any other alert: None)."""
    why = _ALERTS.get(alert.replace("_", "").lower())
    return f"{where} refused the TLS handshake (its alert: {alert}); {why}" if why else None


def no_such_host(host: str, said: str, proxy: bool = False) -> str:
    """What to do where the resolver answered that ``host`` does not exist (``said``, its
    words): a name mistyped (an endpoint's, a proxy's, or a region or account in a service's
    host name) is said at once, since no wait mends it. A resolver out of reach, or one that
    fails for the moment, is an outage, not this."""
    if proxy:
        return f"the host {host} of the proxy does not exist ({said}); check the proxy's URL"
    return (
        f"the host {host} does not exist ({said}); check its name (the endpoint's, or the "
        "region or account it is made of) and the DNS this machine uses"
    )


def speaks_tls(where: str, reason: str) -> str:
    """What to do where ``where``, written with ``http://``, answered that it takes TLS only
    (``reason``, its words: a Go server's, nginx's)."""
    secure = f"; write it as https://{where[7:]}" if where.startswith("http://") else ""
    return f"{where} speaks TLS only (its answer: {reason}){secure}"
