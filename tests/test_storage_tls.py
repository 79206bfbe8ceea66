"""S3 over TLS as users run it: the endpoint's CA trusted through ``AWS_CA_BUNDLE``, a profile's
``endpoint_url`` and keys found by botocore's chain. A certificate that cannot be trusted is a
clear error at once (naming the endpoint and the variable to set), never an outage to wait out
and never a fall back to plain HTTP; nothing is written."""

from __future__ import annotations

import socket
import ssl
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import servers
from http_proxy import ForwardProxy

from bt_agent.errors import AccessDeniedError, StoreError, TransientStoreError
from bt_agent.settings import Environ
from bt_agent.storage import ObjectStore, open_store
from bt_agent.storage.retry import RetryPolicy
from bt_agent.storage.s3 import S3Store

SECRET = (
    f'{{"aws_access_key_id": "{servers.ACCESS_KEY}", '
    f'"aws_secret_access_key": "{servers.SECRET_KEY}"}}'
)


def _bucket(server: servers.SeaweedFS) -> str:
    bucket = f"t{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    return bucket


def _absent(server: servers.SeaweedFS, bucket: str) -> bool:
    return "Contents" not in server.client().list_objects_v2(Bucket=bucket)


def _refused(store: ObjectStore, act: Callable[[], object] | None = None) -> StoreError:
    """The error of ``act`` (by default a write) on ``store``: at once, and not an outage."""
    started = time.monotonic()
    with pytest.raises(StoreError) as caught:
        (act or (lambda: store.write_bytes("model.bin", b"weights")))()
    assert time.monotonic() - started < 10, "a certificate error is not waited out"
    assert not isinstance(caught.value, TransientStoreError)
    return caught.value


def test_a_ca_that_did_not_sign_the_certificate_is_a_clear_error(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    other = servers.certificates(tmp_path / "other-ca")
    bucket = _bucket(s3_server)
    environ = {"AWS_ENDPOINT_URL": s3_server.https_endpoint}
    for trusted in ({"AWS_CA_BUNDLE": str(other.ca)}, {}):  # another CA; the system's roots
        store = open_store(f"s3://{bucket}/x", Environ({**environ, **trusted}), SECRET, "creds")
        assert isinstance(store, S3Store)
        message = str(_refused(store))
        assert "certificate" in message and "AWS_CA_BUNDLE" in message, message
        assert s3_server.https_endpoint in message, message
    assert _absent(s3_server, bucket)


def test_a_certificate_for_another_host_is_a_clear_error(s3_server: servers.SeaweedFS) -> None:
    """The server's certificate names localhost; 127.0.0.1 is not a name it holds."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    endpoint = s3_server.https_endpoint.replace("localhost", "127.0.0.1")
    environ = Environ(
        {"AWS_ENDPOINT_URL": endpoint, "AWS_CA_BUNDLE": str(s3_server.certificates.ca)}
    )
    store = open_store(f"s3://{bucket}/x", environ, SECRET, "creds")
    assert isinstance(store, S3Store)
    message = str(_refused(store))
    assert "another host name" in message and endpoint in message, message
    assert _absent(s3_server, bucket)


def test_an_expired_certificate_is_a_clear_error(tmp_path: Path) -> None:
    """An endpoint whose certificate expired yesterday (signed by a CA that is trusted): the
    handshake is refused at once, and the error says what is wrong with it."""
    expired = servers.certificates(tmp_path / "tls", ("localhost",), days=-1)
    server = servers.static_https(tmp_path, expired)
    try:
        endpoint = f"https://localhost:{server.port}"
        environ = Environ({"AWS_ENDPOINT_URL": endpoint, "AWS_CA_BUNDLE": str(expired.ca)})
        store = open_store("s3://bucket/x", environ, SECRET, "creds")
        assert isinstance(store, S3Store)
        message = str(_refused(store))
    finally:
        server.stop()
    assert "not valid now (Expired" in message and endpoint in message, message


def test_a_missing_ca_bundle_file_names_the_variable(s3_server: servers.SeaweedFS) -> None:
    environ = Environ(
        {"AWS_ENDPOINT_URL": s3_server.https_endpoint, "AWS_CA_BUNDLE": "/nonexistent/ca.pem"}
    )
    store = open_store("s3://bucket/x", environ, SECRET, "creds")
    assert isinstance(store, S3Store)
    message = str(_refused(store))
    assert "AWS_CA_BUNDLE=/nonexistent/ca.pem" in message and "PEM" in message, message


def test_a_ca_bundle_that_holds_no_certificate_names_the_variable(
    s3_server: servers.SeaweedFS, tmp_path: Path
) -> None:
    """A file that is not PEM (a DER file, a key, a path mistyped onto another file) is the
    same clear error, not the engine's exception."""
    bundle = tmp_path / "ca.der"
    bundle.write_bytes(b"\x30\x82\x01\x0a not a certificate")
    environ = Environ({"AWS_ENDPOINT_URL": s3_server.https_endpoint, "AWS_CA_BUNDLE": str(bundle)})
    store = open_store("s3://bucket/x", environ, SECRET, "creds")
    assert isinstance(store, S3Store)
    message = str(_refused(store))
    assert f"AWS_CA_BUNDLE={bundle} holds no PEM certificate" in message, message


#: The ways a shared config file names S3's endpoint for a profile: its own ``endpoint_url``;
#: a ``services`` section (AWS's service-specific form, which botocore reads first); an ``s3``
#: subsection of the profile (the form of the AWS CLI's endpoint plugin).
ENDPOINT_FORMS = {
    "profile": "endpoint_url = {endpoint}\n",
    "services": "services = local\n[services local]\ns3 =\n  endpoint_url = {endpoint}\n",
    "s3-section": "s3 =\n  endpoint_url = {endpoint}\n",
}


@pytest.mark.parametrize("form", list(ENDPOINT_FORMS))
def test_a_profile_gives_the_endpoint_and_the_keys(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """No key in the environment: botocore's chain reads the profile of AWS_PROFILE in a
    shared config file (its endpoint, in each form, region and ca_bundle) and its credentials
    file."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)  # by the test's own client, before the profile is set
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(
        "[profile staging]\n"
        "region = us-east-1\n"
        f"ca_bundle = {s3_server.certificates.ca}\n"
        + ENDPOINT_FORMS[form].format(endpoint=s3_server.https_endpoint)
    )
    credentials.write_text(
        "[staging]\n"
        f"aws_access_key_id = {servers.ACCESS_KEY}\n"
        f"aws_secret_access_key = {servers.SECRET_KEY}\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "staging")
    store = open_store(f"s3://{bucket}/p", Environ({"AWS_PROFILE": "staging"}))
    assert isinstance(store, S3Store)
    assert store.write_bytes("model.bin", b"weights")
    assert store.read_bytes("model.bin") == b"weights"
    monkeypatch.delenv("AWS_PROFILE")
    assert not _absent(s3_server, bucket)


@pytest.mark.parametrize("where", ["AWS_CONFIG_FILE", "HOME"])
@pytest.mark.parametrize("form", list(ENDPOINT_FORMS))
def test_a_profile_gives_the_endpoint_to_keys_of_the_environment(
    s3_server: servers.SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
    where: str,
) -> None:
    """Keys and a region in the environment (the engine needs nothing else), and the default
    profile of the shared config (the file ``AWS_CONFIG_FILE`` names, or ``~/.aws/config``)
    names the endpoint and the CA: requests go there, trusting it, as botocore's would, not to
    AWS."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    config = tmp_path / ".aws" / "config"
    config.parent.mkdir()
    config.write_text(
        "[default]\n"
        f"ca_bundle = {s3_server.certificates.ca}\n"
        + ENDPOINT_FORMS[form].format(endpoint=s3_server.https_endpoint)
    )
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("AWS_CONFIG_FILE", raising=False)
    place = str(config if where == "AWS_CONFIG_FILE" else tmp_path)  # the file, or the home
    monkeypatch.setenv(where, place)
    environ = {
        "AWS_ACCESS_KEY_ID": servers.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": servers.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        where: place,
    }
    store = open_store(f"s3://{bucket}/p", Environ(environ))
    assert isinstance(store, S3Store)
    assert store.write_bytes("model.bin", b"weights")
    assert store.read_bytes("model.bin") == b"weights"
    assert store.endpoint_url == s3_server.https_endpoint


def test_the_s3_endpoint_variable_comes_before_the_global_one(
    s3_server: servers.SeaweedFS,
) -> None:
    """``AWS_ENDPOINT_URL_S3`` names S3's endpoint over ``AWS_ENDPOINT_URL`` (another service's,
    here nothing at all), as botocore reads them."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    environ = Environ(
        {
            "AWS_ENDPOINT_URL_S3": s3_server.https_endpoint,
            "AWS_ENDPOINT_URL": "https://127.0.0.1:9",
            "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        }
    )
    store = open_store(f"s3://{bucket}/p", environ, SECRET, "creds")
    assert store.write_bytes("model.bin", b"weights")
    assert store.read_bytes("model.bin") == b"weights"


def test_the_engine_s_own_endpoint_variable_is_the_agent_s_too(
    s3_server: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_ENDPOINT``, the engine's name for the endpoint (which it reads itself where it is
    given none): the agent takes it too, for the engine's requests and for its own made through
    botocore (aborts), none of which go to AWS."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    for name in ("AWS_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    ca = str(s3_server.certificates.ca)
    environ = Environ({"AWS_ENDPOINT": s3_server.https_endpoint, "AWS_CA_BUNDLE": ca})
    store = open_store(f"s3://{bucket}/p", environ, SECRET, "creds")
    assert isinstance(store, S3Store)
    assert store.write_bytes("model.bin", b"weights")
    assert store.read_bytes("model.bin") == b"weights"
    assert store.abort_uploads("") == 0


@pytest.mark.parametrize("configured", ["variable", "profile"])
def test_configured_endpoints_are_ignored_where_the_setting_says_so(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configured: str
) -> None:
    """``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true``: neither the variable's endpoint (which the
    engine would read itself) nor the profile's is taken, and requests go to AWS's own. There is
    no AWS here: a proxy takes every connection to SeaweedFS (whose certificate holds AWS's
    name), and tells which host each was for."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    nowhere = f"http://127.0.0.1:{servers.free_port()}"
    config = tmp_path / "config"
    config.write_text("[default]\n" + ENDPOINT_FORMS["services"].format(endpoint=nowhere))
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    environ = {
        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        "HTTPS_PROXY": proxy.endpoint,
        "AWS_CONFIG_FILE": str(config),
    }
    if configured == "variable":
        environ["AWS_ENDPOINT_URL"] = nowhere
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    try:
        with open_store(f"s3://{bucket}/p", Environ(environ), SECRET, "c") as store:
            assert store.write_bytes("model.bin", b"weights")
            assert store.read_bytes("model.bin") == b"weights"
        assert set(proxy.targets) == {"s3.us-east-1.amazonaws.com:443"}, proxy.targets
    finally:
        proxy.close()


def test_credentials_that_expire_are_asked_for_again(
    s3_server: servers.SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile's credential_process hands out keys that expire within a minute: botocore's
    chain, as the engine's credential provider, is asked again as they near their expiry, and
    an upload of many requests goes through."""
    bucket = _bucket(s3_server)
    calls = tmp_path / "calls"
    helper = tmp_path / "credentials.py"
    helper.write_text(
        "import datetime, json, sys\n"
        f"open({str(calls)!r}, 'a').write('x')\n"
        "expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)\n"
        "print(json.dumps({'Version': 1, "
        f"'AccessKeyId': {servers.ACCESS_KEY!r}, 'SecretAccessKey': {servers.SECRET_KEY!r}, "
        "'Expiration': expires.isoformat()}))\n"
    )
    config = tmp_path / "config"
    config.write_text(
        f"[profile short]\nregion = us-east-1\ncredential_process = {sys.executable} {helper}\n"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "short")
    store = open_store(f"s3://{bucket}/p", Environ({"AWS_ENDPOINT_URL": s3_server.endpoint}))
    assert isinstance(store, S3Store)
    for index in range(3):
        assert store.write_bytes(f"f{index}.bin", b"weights")
        time.sleep(0.2)
    monkeypatch.delenv("AWS_PROFILE")
    assert len(calls.read_text()) >= 2, "the expiring keys were asked for again"
    assert store.read_bytes("f2.bin") == b"weights"


@pytest.mark.parametrize("transport", ["http", "https"])
def test_the_proxy_variables_are_honoured(s3_server: servers.SeaweedFS, transport: str) -> None:
    """``HTTPS_PROXY`` for an https endpoint (a tunnel: TLS end to end, the endpoint's CA still
    the one trusted), ``HTTP_PROXY`` for a plain one; ``NO_PROXY`` sends its hosts direct."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    endpoint = s3_server.https_endpoint if transport == "https" else s3_server.endpoint
    where = urlsplit(endpoint)
    proxy = ForwardProxy()
    environ = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        f"{transport.upper()}_PROXY": proxy.endpoint,
    }
    try:
        for bypass in ("", f"example.com,{where.hostname}"):
            before = len(proxy.targets)
            key = "direct.bin" if bypass else "proxied.bin"
            url = f"s3://{bucket}/x"
            with open_store(url, Environ({**environ, "NO_PROXY": bypass}), SECRET, "c") as store:
                store.write_bytes(key, b"weights")
                assert store.read_bytes(key) == b"weights"
                assert key in {info.key for info in store.list()}
            taken = proxy.targets[before:]
            if bypass:
                assert taken == [], f"{bypass} goes direct, yet the proxy took {taken}"
            else:
                assert taken and set(taken) == {where.netloc}, taken
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("settings", "host"),
    [
        ({}, "s3.us-east-1.amazonaws.com"),
        ({"AWS_DEFAULT_REGION": "cn-north-1"}, "s3.cn-north-1.amazonaws.com.cn"),
        ({"AWS_USE_FIPS_ENDPOINT": "true"}, "s3-fips.us-east-1.amazonaws.com"),
        ({"AWS_USE_DUALSTACK_ENDPOINT": "true"}, "s3.dualstack.us-east-1.amazonaws.com"),
        (
            {"AWS_USE_FIPS_ENDPOINT": "true", "AWS_USE_DUALSTACK_ENDPOINT": "true"},
            "s3-fips.dualstack.us-east-1.amazonaws.com",
        ),
    ],
    ids=["regional", "china", "fips", "dualstack", "both"],
)
def test_aws_endpoints_are_the_ones_botocore_names(
    s3_server: servers.SeaweedFS, settings: dict[str, str], host: str
) -> None:
    """No endpoint given: requests go to S3's endpoint of the region, in its partition's domain,
    or the FIPS or dual-stack one the variables choose. There is no AWS here: a proxy takes
    every connection to SeaweedFS (whose certificate holds those names), and tells which host
    each was for."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    environ = {
        "AWS_DEFAULT_REGION": "us-east-1",
        **settings,
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        "HTTPS_PROXY": proxy.endpoint,
    }
    try:
        with open_store(f"s3://{bucket}/p", Environ(environ), SECRET, "c") as store:
            assert isinstance(store, S3Store)
            assert store.write_bytes("model.bin", b"weights")
            assert store.read_bytes("model.bin") == b"weights"
            assert store.endpoint_url == f"https://{host}"
        assert set(proxy.targets) == {f"{host}:443"}, proxy.targets
    finally:
        proxy.close()


def test_a_certificate_of_aws_s_endpoint_not_trusted_names_it(s3_server: servers.SeaweedFS) -> None:
    """No endpoint given, and AWS's certificate not trusted, as behind a proxy that inspects TLS
    with a CA of its own (here the proxy takes every connection to SeaweedFS, whose certificate
    holds AWS's name, signed by a CA the system does not trust): a clear error at once, naming
    the endpoint and the variable that trusts the CA."""
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    environ = Environ({"AWS_DEFAULT_REGION": "us-east-1", "HTTPS_PROXY": proxy.endpoint})
    try:
        with open_store(f"s3://{_bucket(s3_server)}/p", environ, SECRET, "c") as store:
            message = str(_refused(store))
    finally:
        proxy.close()
    assert "certificate of https://s3.us-east-1.amazonaws.com is not trusted" in message, message
    assert "set AWS_CA_BUNDLE" in message, message


def test_an_aws_endpoint_out_of_reach_is_named() -> None:
    """No endpoint given, and AWS out of reach (here its proxy refuses every connection): the
    error names the endpoint the requests were for, and the proxy, as it does for one given."""
    proxy = f"http://127.0.0.1:{servers.free_port()}"  # nothing listens there
    environ = Environ({"AWS_DEFAULT_REGION": "eu-west-1", "HTTPS_PROXY": proxy})
    store = open_store("s3://bucket/x", environ, SECRET, "creds")
    store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
    with store, pytest.raises(TransientStoreError) as refused:
        store.write_bytes("model.bin", b"weights")
    said = f"cannot reach https://s3.eu-west-1.amazonaws.com through the proxy {proxy} ("
    assert said in str(refused.value), refused.value


@pytest.mark.parametrize("exists", [True, False])
def test_r2_goes_to_the_account_s_endpoint(s3_server: servers.SeaweedFS, exists: bool) -> None:
    """``r2://<account>.<bucket>`` goes to the account's endpoint. A bucket it does not hold is
    an error that says where else it may be: in one of R2's jurisdictions, whose endpoints are
    their own. There is no R2 here: a proxy takes every connection to SeaweedFS (whose
    certificate holds the account endpoint's name), and tells which host each was for."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server) if exists else "no-such-bucket"
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    environ = {"AWS_CA_BUNDLE": str(s3_server.certificates.ca), "HTTPS_PROXY": proxy.endpoint}
    try:
        with open_store(f"r2://acct.{bucket}/p", Environ(environ), SECRET, "c") as store:
            if exists:
                assert store.write_bytes("model.bin", b"weights")
                assert store.read_bytes("model.bin") == b"weights"
            else:
                message = str(_refused(store, store.list))
        assert set(proxy.targets) == {f"{servers.R2_NAMES[0]}:443"}, proxy.targets
    finally:
        proxy.close()
    if not exists:
        assert f"the bucket of r2://acct.{bucket}/p does not exist" in message, message
        assert "set BT_R2_ENDPOINT_URL=https://acct.<jurisdiction>.r2.cloud" in message, message


def test_a_directory_bucket_goes_to_its_zone(s3_server: servers.SeaweedFS) -> None:
    """A bucket named as S3 Express One Zone names its directory buckets goes to the zonal
    endpoint of its zone. SeaweedFS has no S3 Express (no ``CreateSession``), and its
    certificate does not hold the zone's name: this test checks where the requests go, and
    that the refusal is a clear error at once, naming the zone's endpoint."""
    assert s3_server.certificates is not None
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    environ = {
        "AWS_DEFAULT_REGION": "us-west-2",
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        "HTTPS_PROXY": proxy.endpoint,
    }
    bucket = "models--usw2-az1--x-s3"
    try:
        with open_store(f"s3://{bucket}/p", Environ(environ), SECRET, "c") as store:
            assert isinstance(store, S3Store)
            message = str(_refused(store))
        zone = f"{bucket}.s3express-usw2-az1.us-west-2.amazonaws.com"
        assert set(proxy.targets) == {f"{zone}:443"}, proxy.targets
        assert "certificate" in message and f"https://{zone}" in message, message
    finally:
        proxy.close()


@pytest.mark.parametrize("transport", ["https", "lota"])
def test_coreweave_buckets_are_named_in_the_host(
    s3_server: servers.SeaweedFS, transport: str
) -> None:
    """``cw://bucket/path`` goes to CoreWeave AI Object Storage, which takes only
    virtual-hosted requests: ``https://<bucket>.cwobject.com``, or inside CoreWeave the LOTA
    endpoint ``BT_CW_ENDPOINT_URL=http://cwlota.com`` (``http://<bucket>.cwlota.com``). There is
    no CoreWeave here: a proxy takes every connection to SeaweedFS, which finds the bucket in
    the host (its certificate holds ``*.cwobject.com``), and tells which host each was for."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    https = transport == "https"
    port = s3_server.https_port if https else s3_server.port
    proxy = ForwardProxy(upstream=("127.0.0.1", port))
    environ = {"AWS_DEFAULT_REGION": "US-EAST-04A"}
    if https:
        environ |= {"AWS_CA_BUNDLE": str(s3_server.certificates.ca), "HTTPS_PROXY": proxy.endpoint}
        host = f"{bucket}.cwobject.com:443"
    else:
        environ |= {"BT_CW_ENDPOINT_URL": "http://cwlota.com", "HTTP_PROXY": proxy.endpoint}
        host = f"{bucket}.cwlota.com"  # a request in absolute form, its port the default
    client = s3_server.client()
    begun = client.create_multipart_upload(Bucket=bucket, Key="models/left.bin")["UploadId"]
    try:
        with open_store(f"cw://{bucket}/models", Environ(environ), SECRET, "c") as store:
            assert store.write_bytes("config.json", b"{}")
            assert [info.key for info in store.list()] == ["config.json"]
            assert store.read_bytes("config.json") == b"{}"
            assert store.abort_uploads("") == 1  # botocore's requests, the same way
        assert set(proxy.targets) == {host}, proxy.targets
        assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads"), begun
        listed = s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]
        assert [item["Key"] for item in listed] == ["models/config.json"]
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("profile", "host"),
    [
        (
            "region = us-east-1\ns3 =\n    use_dualstack_endpoint = true\n",
            "s3.dualstack.us-east-1.amazonaws.com",
        ),
        (
            "region = US-EAST-04A\nendpoint_url = https://cwobject.com\n"
            "s3 =\n    addressing_style = virtual\n",
            "{bucket}.cwobject.com",
        ),
    ],
    ids=["dualstack", "virtual-hosted"],
)
def test_a_profile_chooses_where_requests_go(
    s3_server: servers.SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    profile: str,
    host: str,
) -> None:
    """No key in the environment: the profile's ``s3`` section asks for dual-stack, or (as
    CoreWeave's documents have users write it) its ``endpoint_url`` with ``addressing_style =
    virtual`` names the bucket in the host, as the AWS CLI reads them."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    s3_server.client().create_multipart_upload(Bucket=bucket, Key="p/left.bin")
    proxy = ForwardProxy(upstream=("127.0.0.1", s3_server.https_port))
    config = tmp_path / "config"
    config.write_text(
        f"[profile p]\naws_access_key_id = {servers.ACCESS_KEY}\n"
        f"aws_secret_access_key = {servers.SECRET_KEY}\n{profile}"
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "p")
    environ = {
        "AWS_PROFILE": "p",
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        "HTTPS_PROXY": proxy.endpoint,
    }
    try:
        with open_store(f"s3://{bucket}/p", Environ(environ)) as store:
            assert store.write_bytes("model.bin", b"weights")
            assert store.read_bytes("model.bin") == b"weights"
            assert store.abort_uploads("") == 1  # botocore's requests, the same way
        assert set(proxy.targets) == {f"{host.format(bucket=bucket)}:443"}, proxy.targets
    finally:
        proxy.close()


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://host", "localhost:9000", "https://"])
def test_an_endpoint_that_is_no_url_is_a_clear_error(endpoint: str) -> None:
    """The engine takes any text as the endpoint and then fails every request on it, as if the
    service were down (or panics): the store says at once what is wrong, and nothing waits."""
    started = time.monotonic()
    environ = Environ({"AWS_ENDPOINT_URL": endpoint})
    with (
        open_store("s3://bucket/p", environ, SECRET, "c") as store,
        pytest.raises(StoreError) as caught,
    ):
        store.list()
    assert not isinstance(caught.value, TransientStoreError)
    assert f"the endpoint {endpoint!r} is not an http:// or https:// URL" in str(caught.value)
    assert time.monotonic() - started < 5


def test_a_proxy_given_as_host_and_port_is_used(s3_server: servers.SeaweedFS) -> None:
    """``HTTPS_PROXY=host:port``, without a scheme, as curl takes it."""
    assert s3_server.certificates is not None
    bucket = _bucket(s3_server)
    proxy = ForwardProxy()
    environ = {
        "AWS_ENDPOINT_URL": s3_server.https_endpoint,
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
        "HTTPS_PROXY": proxy.endpoint.removeprefix("http://"),
    }
    try:
        with open_store(f"s3://{bucket}/x", Environ(environ), SECRET, "c") as store:
            assert store.write_bytes("model.bin", b"weights")
        assert set(proxy.targets) == {urlsplit(s3_server.https_endpoint).netloc}, proxy.targets
    finally:
        proxy.close()


def test_a_proxy_that_is_no_url_or_is_down_is_named_without_its_password(
    s3_server: servers.SeaweedFS,
) -> None:
    """A proxy variable that is no URL is an error at once; a proxy that does not answer is an
    outage (it may come back) whose error names it. Neither shows the password a proxy URL
    may hold."""
    assert s3_server.certificates is not None
    trusted = {
        "AWS_ENDPOINT_URL": s3_server.https_endpoint,
        "AWS_CA_BUNDLE": str(s3_server.certificates.ca),
    }
    garbled = Environ({**trusted, "HTTPS_PROXY": "http://user:hunter2@"})
    with open_store("s3://bucket/x", garbled, SECRET, "c") as store:
        refused = _refused(store)
    assert "HTTPS_PROXY, HTTP_PROXY or ALL_PROXY) is not a URL" in str(refused), refused
    port = servers.free_port()
    down = Environ({**trusted, "HTTPS_PROXY": f"http://user:hunter2@127.0.0.1:{port}"})
    with open_store("s3://bucket/x", down, SECRET, "c") as store:
        store.policy = RetryPolicy(attempts=1)
        with pytest.raises(TransientStoreError) as caught:
            store.list()
    assert f"through the proxy http://127.0.0.1:{port}" in str(caught.value), caught.value
    assert "hunter2" not in f"{refused} {caught.value}"
    bare = Environ({**trusted, "HTTPS_PROXY": f"127.0.0.1:{port}"})  # host:port, as curl takes it
    with open_store("s3://bucket/x", bare, SECRET, "c") as store:
        store.policy = RetryPolicy(attempts=1)
        with pytest.raises(TransientStoreError) as named:
            store.list()
    assert f"through the proxy http://127.0.0.1:{port}" in str(named.value), named.value


#: What each client says of a certificate it refuses: the engine's (rustls) for ``https://``
#: weights, the standard library's (OpenSSL) for huggingface_hub's.
REFUSED = {
    ("https", "untrusted"): "is not trusted (UnknownIssuer); set SSL_CERT_FILE",
    ("https", "other-host"): "is for another host name (NotValidForName",
    ("https", "expired"): "is not valid now (Expired",
    ("hf", "untrusted"): "is not trusted (unable to get local issuer certificate); set SSL_CERT",
    ("hf", "other-host"): "is for another host name (IP address mismatch",
    ("hf", "expired"): "is not valid now (certificate has expired)",
}


@pytest.mark.parametrize(("source", "case"), list(REFUSED))
def test_a_source_whose_certificate_is_refused_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, case: str
) -> None:
    """``https://`` weights (the engine's client) and a Hub mirror (``HF_ENDPOINT``,
    huggingface_hub's) refuse a certificate as the stores do: at once, saying what is wrong with
    it and what to do, never an outage waited out (nor an unreachable Hub)."""
    from huggingface_hub.utils import close_session

    tls = servers.certificates(
        tmp_path / "tls", ("localhost",), days=-1 if case == "expired" else 2
    )
    server = servers.static_https(tmp_path, tls)
    try:
        (server.directory / "model.bin").write_bytes(b"weights")
        if case != "untrusted":
            monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca))
        close_session()  # huggingface_hub's client reads SSL_CERT_FILE as it is made
        url = server.url("model.bin")
        if case == "other-host":
            url = url.replace("localhost", "127.0.0.1")
        where = url.rpartition("/")[0]
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            if source == "https":
                open_store(url).list()
            else:
                open_store("hf://org/model", Environ({"HF_ENDPOINT": where})).list()
    finally:
        server.stop()
        close_session()
    assert not isinstance(caught.value, TransientStoreError)
    assert time.monotonic() - started < 5
    said = REFUSED[source, case]
    assert f"the TLS certificate of {where} {said}" in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("profile", "said"),
    [
        ("", "no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
        (
            'credential_process = sh -c "echo the SSO session expired >&2; exit 1"\n',
            "CredentialRetrievalError: Error when retrieving credentials from custom-process: "
            "the SSO session expired",
        ),
    ],
    ids=["none", "process-fails"],
)
def test_credentials_that_cannot_be_had_say_why(
    s3_server: servers.SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    profile: str,
    said: str,
) -> None:
    """botocore's chain finds no credentials, or a profile's ``credential_process`` fails: the
    error is the chain's own (it said "access denied (forbidden); check the credentials and the
    bucket's policy", as if the service had refused a request)."""
    config = tmp_path / "config"
    config.write_text(f"[profile p]\nregion = us-east-1\n{profile}")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "p")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    environ = Environ({"AWS_PROFILE": "p", "AWS_ENDPOINT_URL": s3_server.endpoint})
    with open_store("s3://bucket/p", environ) as store, pytest.raises(AccessDeniedError) as caught:
        store.list()
    assert str(caught.value).startswith("s3://bucket/p: ") and said in str(caught.value)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ("[profile other]\nregion = us-east-1\n", "The config profile (p) could not be found"),
        ("[profile p\nregion = us-east-1\n", "Unable to parse config file"),
    ],
    ids=["profile-missing", "config-malformed"],
)
def test_an_aws_configuration_that_cannot_be_used_says_why(
    s3_server: servers.SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: str,
    said: str,
) -> None:
    """``AWS_PROFILE`` names a profile the config file does not hold, or the file cannot be
    parsed: botocore's own words, the variables to check, at once (it was a traceback)."""
    (tmp_path / "config").write_text(config)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_PROFILE", "p")
    environ = Environ({"AWS_PROFILE": "p", "AWS_ENDPOINT_URL": s3_server.endpoint})
    with open_store("s3://bucket/p", environ) as store:
        message = str(_refused(store, store.list))
    assert message.startswith("s3://bucket/p: the AWS configuration cannot be used ("), message
    assert said in message and "check AWS_PROFILE" in message, message


@pytest.mark.parametrize("service", ["gs", "azure"])
@pytest.mark.parametrize("trusted", ["other-ca", "none"])
def test_gcs_and_azure_refuse_an_untrusted_certificate_at_once(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    service: str,
    trusted: str,
) -> None:
    """gs:// (google-cloud-storage, through requests) and azure:// (the engine) over https, the
    server's CA not trusted (another CA given, or none): listing and writing are each a clear
    error at once, naming the endpoint and the variable that trusts a CA (they used to be
    an unreachable store for gs://, its listing retried for minutes), and nothing is written."""
    other = servers.certificates(tmp_path / "other-ca")
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    if service == "gs":
        gcs: servers.FakeGCS = request.getfixturevalue("gcs_tls_server")
        bucket = f"t{uuid.uuid4().hex[:12]}"
        gcs.create_bucket(bucket)
        if trusted == "other-ca":
            monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other.ca))
        url, variable = f"gs://{bucket}/p", "REQUESTS_CA_BUNDLE"
        store = open_store(url, Environ({"STORAGE_EMULATOR_HOST": gcs.endpoint}))
        endpoint, objects = gcs.endpoint, gcs.data / bucket
    else:
        azure: servers.Azurite = request.getfixturevalue("azure_tls_server")
        container = f"t{uuid.uuid4().hex[:12]}"
        azure.create_container(container)
        url, variable = f"azure://{servers.AZURITE_ACCOUNT}/{container}/p", "SSL_CERT_FILE"
        environ = Environ({"SSL_CERT_FILE": str(other.ca)} if trusted == "other-ca" else {})
        store = open_store(url, environ, azure.connection_string, "azure_creds")
        endpoint, objects = azure.endpoint, None
    for step in (store.list, None):  # a listing, a write
        message = str(_refused(store, step))
        assert f"the TLS certificate of {endpoint}" in message, message
        assert "is not trusted" in message and f"set {variable} to the PEM file" in message
    if objects is not None:
        assert not any(objects.rglob("*model.bin*"))
    else:
        trusting = Environ({"SSL_CERT_FILE": str(azure.tls.ca)} if azure.tls else {})
        with open_store(url, trusting, azure.connection_string, "azure_creds") as seen:
            assert seen.list() == []


@pytest.mark.parametrize("service", ["azure", "https"])
def test_azure_and_https_trust_the_ca_file_of_either_variable(
    request: pytest.FixtureRequest, tmp_path: Path, service: str
) -> None:
    """``REQUESTS_CA_BUNDLE`` (where Azure's CLI and Python SDK are told of a private CA, a
    proxy's that inspects TLS most often) is trusted where ``SSL_CERT_FILE`` is unset, which
    comes first; errors name the variable that named the file."""
    if service == "azure":
        azure: servers.Azurite = request.getfixturevalue("azure_tls_server")
        assert azure.tls is not None
        container = f"t{uuid.uuid4().hex[:12]}"
        azure.create_container(container)
        url, ca = f"azure://{servers.AZURITE_ACCOUNT}/{container}/p", azure.tls.ca

        def opening(environ: dict[str, str]) -> ObjectStore:
            return open_store(url, Environ(environ), azure.connection_string, "azure_creds")
    else:
        https: servers.StaticHTTPS = request.getfixturevalue("https_server")
        (https.directory / "ca-check.bin").write_bytes(b"weights")
        url, ca = https.url("ca-check.bin"), https.ca_file

        def opening(environ: dict[str, str]) -> ObjectStore:
            return open_store(url, Environ(environ))

    with opening({"REQUESTS_CA_BUNDLE": str(ca)}) as store:
        store.list()
    other = servers.certificates(tmp_path / "other-ca")
    with opening({"SSL_CERT_FILE": str(other.ca), "REQUESTS_CA_BUNDLE": str(ca)}) as store:
        message = str(_refused(store, store.list))
    assert "is not trusted" in message and "set SSL_CERT_FILE to the PEM file" in message, message
    missing = tmp_path / "missing.pem"
    with opening({"REQUESTS_CA_BUNDLE": str(missing)}) as store:
        message = str(_refused(store, store.list))
    assert f"cannot read REQUESTS_CA_BUNDLE={missing} (" in message, message


@pytest.mark.parametrize("service", ["s3", "azure", "gs", "hf", "https"])
def test_https_to_a_server_of_plain_http_is_a_clear_error_at_once(
    request: pytest.FixtureRequest, s3_server: servers.SeaweedFS, service: str
) -> None:
    """An endpoint written with ``https://`` whose server speaks plain HTTP (a local MinIO or
    emulator, most often) answers the handshake with no TLS record: each client says so at once,
    with the URL to write instead (the engine's stores waited it out as an outage for five
    minutes), rather than retrying what no wait mends."""
    plain = {
        "s3": s3_server,
        "azure": request.getfixturevalue("azure_server") if service == "azure" else None,
        "gs": request.getfixturevalue("gcs_server") if service == "gs" else None,
        "hf": request.getfixturevalue("hf_server") if service == "hf" else None,
        "https": s3_server,
    }[service]
    assert plain is not None and plain.tls is None
    secure = f"https://127.0.0.1:{plain.port}"
    endpoint = secure  # as the error names it
    if service == "s3":
        store = open_store("s3://bucket/x", Environ({"AWS_ENDPOINT_URL": secure}), SECRET, "c")
    elif service == "azure":
        assert isinstance(plain, servers.Azurite)
        secret = plain.connection_string.replace("http", "https")
        endpoint = f"{secure}/{servers.AZURITE_ACCOUNT}"  # a connection string's BlobEndpoint
        store = open_store(f"azure://{servers.AZURITE_ACCOUNT}/c/x", Environ({}), secret, "c")
    elif service == "gs":
        store = open_store("gs://bucket/x", Environ({"STORAGE_EMULATOR_HOST": secure}))
    elif service == "hf":
        store = open_store("hf://org/model", Environ({"HF_ENDPOINT": secure}))
    else:
        store = open_store(f"{secure}/bucket/model.bin")
    with store:
        message = str(_refused(store, store.list))
    assert f"{endpoint} does not speak TLS (its answer is no TLS record: " in message, message
    plain_url = endpoint.replace("https://", "http://")
    assert message.endswith(f"if it serves plain HTTP, write it as {plain_url}"), message


@pytest.mark.parametrize("service", ["s3", "azure"])
def test_http_to_a_server_of_tls_says_to_write_https(
    request: pytest.FixtureRequest, s3_server: servers.SeaweedFS, service: str
) -> None:
    """The other way round: an endpoint written with ``http://`` whose server takes TLS only.
    Each request is a clear error at once with the URL to write, whether the server says why
    (Go's 400 to a listing: "Client sent an HTTP request to an HTTPS server") or not: a write
    cut off as its body is sent (Go, Node), a HEAD's 400 without a body; there the engine's
    store tries a TLS handshake of its own (these were an outage waited out for minutes)."""
    if service == "s3":
        plain = f"http://localhost:{s3_server.https_port}"  # its port of TLS
        environ = Environ({"AWS_ENDPOINT_URL": plain})
        store = open_store(f"s3://{_bucket(s3_server)}/x", environ, SECRET, "creds")
    else:
        azure: servers.Azurite = request.getfixturevalue("azure_tls_server")
        container = f"t{uuid.uuid4().hex[:12]}"
        azure.create_container(container)
        secret = azure.connection_string.replace("https://", "http://")
        plain = f"http://127.0.0.1:{azure.port}/{servers.AZURITE_ACCOUNT}"
        store = open_store(
            f"azure://{servers.AZURITE_ACCOUNT}/{container}/x", Environ({}), secret, "c"
        )
    big = b"w" * 4 * 1024 * 1024  # still being sent when the server hangs up
    with store:
        for step in (
            store.list,
            lambda: store.stat("model.bin"),
            lambda: store.write_bytes("m", big),
        ):
            message = str(_refused(store, step))
            assert f"{plain} speaks TLS only (its answer: " in message, message
            assert message.endswith(f"write it as {plain.replace('http', 'https', 1)}"), message


def test_a_server_of_plain_http_that_hangs_up_is_an_outage(s3_server: servers.SeaweedFS) -> None:
    """A connection cut by a server of plain HTTP (here a port where nothing answers a TLS
    handshake) is what an outage looks like: retried, not taken for a server of TLS."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]

        def hang_up() -> None:
            while True:
                try:
                    connection, _ = listening.accept()
                except OSError:
                    return
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.close()  # a reset, to a request and to a handshake alike

        threading.Thread(target=hang_up, daemon=True).start()
        environ = Environ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
        store = open_store("s3://bucket/x", environ, SECRET, "creds")
        store.policy = RetryPolicy(attempts=2, base_seconds=0.01, cap_seconds=0.01)
        with store, pytest.raises(TransientStoreError, match=r"cannot reach http://127\.0\.0\.1"):
            store.write_bytes("model.bin", b"weights")


class _RegionsOfAWS(ThreadingHTTPServer):
    """Stands in for AWS's answers about regions, which no server here gives (SeaweedFS has no
    regions): a HEAD of a bucket gets its region in ``x-amz-bucket-region``, as AWS tells anyone;
    any other request, as if signed for another region, gets what S3 answers one: a redirect
    with no place to go (path style), or with ``malformed`` a 400 naming the region to use."""

    def __init__(self, region: str, malformed: bool = False) -> None:
        self.region, self.malformed = region, malformed
        self.seen: list[str] = []
        super().__init__(("127.0.0.1", 0), self._Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    class _Handler(BaseHTTPRequestHandler):
        server: _RegionsOfAWS

        def _answer(self) -> None:
            region = self.server.region
            self.server.seen.append(f"{self.command} {self.path}")
            body = b""
            if self.command == "HEAD":
                status = 301
            elif self.server.malformed:
                status, body = (
                    400,
                    (
                        "<Error><Code>AuthorizationHeaderMalformed</Code><Message>The "
                        "authorization header is malformed; the region 'us-east-1' is wrong; "
                        f"expecting '{region}'</Message><Region>{region}</Region></Error>"
                    ).encode(),
                )
            else:
                status, body = 301, b"<Error><Code>PermanentRedirect</Code></Error>"
            self.send_response(status)
            self.send_header("x-amz-bucket-region", region)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            pass


def test_a_bucket_outside_the_default_region_is_found_where_no_region_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No region anywhere (secret, environment, profile) and AWS's own endpoint: the region is
    asked of AWS, as botocore finds it, not taken to be us-east-1 (whose endpoint would answer
    every request with a redirect). The answer comes from a stand-in for AWS."""
    aws = _RegionsOfAWS("eu-central-1")
    try:
        monkeypatch.setattr("bt_agent.storage.s3.REGION_ENDPOINT", aws.endpoint)
        for variable in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
            monkeypatch.delenv(variable, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        with open_store("s3://far-bucket/p", Environ({}), SECRET, "creds") as store:
            assert isinstance(store, S3Store)
            assert store.engine.config["region"] == "eu-central-1"
        with store:  # its engine made again after close: the region found is kept
            assert store.engine.config["region"] == "eu-central-1"
            assert store.engine.config["endpoint"] == "https://s3.eu-central-1.amazonaws.com"
        asked = len(aws.seen)
        assert asked and set(aws.seen) == {"HEAD /far-bucket"}  # botocore follows its redirect
        given = Environ({"AWS_DEFAULT_REGION": "us-west-2"})
        with open_store("s3://far-bucket/p", given, SECRET, "creds") as store:
            assert isinstance(store, S3Store)
            assert store.engine.config["region"] == "us-west-2", "a region set is kept"
        given = Environ({"AWS_REGION": "us-west-2"})  # the other SDKs' variable
        with open_store("s3://far-bucket/p", given, SECRET, "creds") as store:
            assert isinstance(store, S3Store)
            assert store.engine.config["region"] == "us-west-2"
        assert len(aws.seen) == asked, "and not asked of AWS"
    finally:
        aws.shutdown()
        aws.server_close()


@pytest.mark.parametrize("malformed", [False, True], ids=["redirect", "malformed"])
def test_a_region_set_that_is_not_the_buckets_is_a_clear_error_at_once(malformed: bool) -> None:
    """Requests signed for a region the bucket is not in: S3's answer (from a stand-in for
    AWS) says so, at once, naming the variable to set; no outage to wait out."""
    aws = _RegionsOfAWS("eu-central-1", malformed)
    environ = Environ({"AWS_ENDPOINT_URL": aws.endpoint, "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        with open_store("s3://far-bucket/p", environ, SECRET, "creds") as store:
            started = time.monotonic()
            message = str(_refused(store))
            assert time.monotonic() - started < 10
        assert "the bucket far-bucket is not in the region us-east-1" in message, message
        assert "set AWS_DEFAULT_REGION (or the secret's aws_region) to its region" in message
        if malformed:
            assert "its region, eu-central-1" in message
    finally:
        aws.shutdown()
        aws.server_close()


@pytest.mark.parametrize(
    "service",
    ["s3", "s3-proxy", "s3-proxy-listed", "s3-direct", "azure", "gs", "hf", "hf-proxy", "https"],
)
def test_a_host_that_does_not_exist_is_a_clear_error_at_once(
    monkeypatch: pytest.MonkeyPatch, unknown_name: str, service: str
) -> None:
    """A host name the resolver says does not exist (an endpoint mistyped, or the region or
    account in a service's host name, or a proxy's) is an error at once that names it, for
    every client: no wait mends it (it was waited out as an outage, five minutes by default).
    Behind a proxy the name looked up is the proxy's; where a ``NO_PROXY`` list is set, the
    one that does not exist is named (``-listed``: the endpoint not in the list, ``-direct``:
    in it, the proxy not used)."""
    mistyped = f"http://{unknown_name}:9000"
    of_proxy = "-proxy" in service
    if of_proxy:  # the proxy's name is what the client looks up, not the endpoint's
        monkeypatch.setenv("HTTPS_PROXY", mistyped)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
    if service.startswith("s3"):
        endpoint = "https://127.0.0.1:9" if of_proxy else mistyped
        proxies = {
            "s3-proxy": {"HTTPS_PROXY": mistyped},
            "s3-proxy-listed": {"HTTPS_PROXY": mistyped, "NO_PROXY": ".internal"},
            "s3-direct": {"HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ".invalid"},
        }
        environ = Environ({"AWS_ENDPOINT_URL": endpoint, **proxies.get(service, {})})
        store = open_store("s3://bucket/x", environ, SECRET, "c")
    elif service == "azure":
        secret = (
            f"DefaultEndpointsProtocol=http;AccountName={servers.AZURITE_ACCOUNT};"
            f"AccountKey={servers.AZURITE_KEY};"
            f"BlobEndpoint={mistyped}/{servers.AZURITE_ACCOUNT};"
        )
        store = open_store(f"azure://{servers.AZURITE_ACCOUNT}/c/x", Environ({}), secret, "c")
    elif service == "gs":
        store = open_store("gs://bucket/x", Environ({"STORAGE_EMULATOR_HOST": mistyped}))
    elif service.startswith("hf"):
        endpoint = "https://hub.example" if of_proxy else mistyped
        store = open_store("hf://org/model", Environ({"HF_ENDPOINT": endpoint}))
    else:
        store = open_store(f"{mistyped}/m/model.bin")
    with store:
        message = str(_refused(store, store.list))
    if of_proxy:
        said = f"the host {unknown_name} of the proxy does not exist ("
        assert said in message and message.endswith("check the proxy's URL"), message
    else:
        assert f"the host {unknown_name} does not exist (" in message, message
        assert "check its name (the endpoint's, or the region or account" in message, message


#: What each of the resolver's answers is, in ``getaddrinfo``'s code and glibc's words.
RESOLVER = {
    socket.EAI_AGAIN: "Temporary failure in name resolution",
    socket.EAI_NONAME: "Name or service not known",
}


@pytest.mark.parametrize("answer", list(RESOLVER), ids=["EAI_AGAIN", "EAI_NONAME"])
def test_a_resolver_that_fails_for_the_moment_is_an_outage(answer: int) -> None:
    """The other answer of a resolver, that it cannot tell for the moment (``EAI_AGAIN``: its
    server out of reach, or failing), is an outage, waited out; the answer that a name does not
    exist is not. No resolver here can be made to give the first: the engine's report of each
    (its words, as it quotes the system's) and the standard library's error stand in."""
    from obstore.exceptions import GenericError

    from bt_agent.storage.engine_errors import typed_error
    from bt_agent.storage.tls import unknown_host

    endpoint, said = "http://127.0.0.1:9", RESOLVER[answer]
    report = GenericError(
        f"Generic S3 error: Error performing GET {endpoint}/b/k in 2.6s, after 10 retries - "
        'HTTP error: error sending request\n ConnectError("dns error", Custom { kind: '
        f'Uncategorized, error: "failed to lookup address information: {said}" }})'
    )
    failing = ConnectionError("cannot connect")
    failing.__cause__ = socket.gaierror(answer, said)
    outage = answer == socket.EAI_AGAIN
    with open_store("s3://b/p", Environ({"AWS_ENDPOINT_URL": endpoint}), SECRET, "c") as store:
        assert isinstance(store, S3Store)
        typed = typed_error(store, report, "k")
    assert isinstance(typed, StoreError) and isinstance(typed, TransientStoreError) == outage
    assert (unknown_host(failing, "https://hub.example") is None) == outage


@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2], ids=["TLSv1.3", "TLSv1.2"]
)
@pytest.mark.parametrize("service", ["s3", "https", "hf", "gs"])
def test_a_server_that_asks_for_a_client_certificate_says_so_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: str, version: ssl.TLSVersion
) -> None:
    """A store of mutual TLS (it asks for a certificate of the client's own, which the agent
    does not send) ends each handshake with an alert: said at once as that, for the engine's
    stores and the standard library's clients alike. The engine's stores said its certificate
    was not trusted (the alert's name holds "Certificate") and to set the CA variable; the
    others waited it out as an outage."""
    from huggingface_hub.utils import close_session

    tls = servers.certificates(tmp_path / "tls")
    for variable in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        monkeypatch.setenv(variable, str(tls.ca))
    close_session()  # huggingface_hub's client reads SSL_CERT_FILE as it is made
    try:
        with servers.asking_a_client_certificate(tls, version) as where:
            if service == "s3":
                environ = Environ({"AWS_ENDPOINT_URL": where, "AWS_CA_BUNDLE": str(tls.ca)})
                store = open_store("s3://bucket/x", environ, SECRET, "c")
            elif service == "https":
                store = open_store(f"{where}/m/model.bin")
            elif service == "hf":
                store = open_store("hf://org/model", Environ({"HF_ENDPOINT": where}))
            else:
                store = open_store("gs://bucket/x", Environ({"STORAGE_EMULATOR_HOST": where}))
            with store:
                message = str(_refused(store, store.list))
    finally:
        close_session()
    assert f"{where} refused the TLS handshake (its alert: " in message, message
    assert "it asks for a client certificate" in message and "not trusted" not in message
