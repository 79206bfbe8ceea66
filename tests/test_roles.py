"""IAM roles the spec names for ``s3://`` sources (``auth_method`` ``AWS_ASSUME_ROLE`` and
``AWS_OIDC``), assumed through a real STS: SeaweedFS's, whose session credentials its S3 gateway
takes, on the same port (as ``AWS_ENDPOINT_URL`` sends both S3's and STS's requests there)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import servers
from helpers import Agent

from bt_agent.errors import AccessDeniedError, UsageError
from bt_agent.settings import Environ
from bt_agent.spec.models import WeightsAuth, WeightsAuthMethod, WeightsSource
from bt_agent.staging.weights import aws_role
from bt_agent.storage import open_store
from bt_agent.storage.credentials import AwsRole
from bt_agent.storage.roles import RoleCredentials

#: A role that may read and list every bucket, and one that no identity may assume.
ROLE, NO_ROLE = "arn:aws:iam::123456789012:role/Weights", "arn:aws:iam::123456789012:role/Nope"
#: The keys of an identity of no rights of its own (the platform's, which assumes the role).
PLATFORM = {"AWS_ACCESS_KEY_ID": "platform-key", "AWS_SECRET_ACCESS_KEY": "platform-secret"}


@pytest.fixture(scope="module")
def issuer() -> Iterator[servers.OidcIssuer]:
    with servers.OidcIssuer().serving() as issuer:
        yield issuer


@pytest.fixture(scope="module")
def sts_s3(
    tmp_path_factory: pytest.TempPathFactory, issuer: servers.OidcIssuer
) -> Iterator[servers.SeaweedFS]:
    """SeaweedFS with an STS that trusts ``issuer``'s tokens; its sessions last 14 minutes,
    within the 15 before expiry in which botocore asks for credentials again, so each use of
    the role's credentials assumes it anew."""
    iam = servers.iam_config(
        {PLATFORM["AWS_ACCESS_KEY_ID"]: PLATFORM["AWS_SECRET_ACCESS_KEY"]},
        {ROLE: ["s3:GetObject", "s3:ListBucket"]},
        session="14m",
        issuer=issuer.url,
    )
    server = servers.seaweedfs(tmp_path_factory.mktemp("sts"), iam=iam)
    try:
        yield server
    finally:
        server.stop()


def _seed(server: servers.SeaweedFS, files: dict[str, bytes]) -> str:
    bucket = f"r{uuid.uuid4().hex[:10]}"
    server.create_bucket(bucket)
    client = server.client()
    for name, body in files.items():
        client.put_object(Bucket=bucket, Key=f"model/{name}", Body=body)
    return f"s3://{bucket}/model"


def _env(server: servers.SeaweedFS, tls: bool = False) -> dict[str, str]:
    """The platform's keys, and where S3 and STS are (over https, their CA trusted)."""
    return {**server.client_env(tls), **PLATFORM}


def _job(source: str, auth: dict[str, str] | None, command: str) -> dict[str, object]:
    weights: dict[str, object] = {"source": source, "mount_location": "/app/model"}
    if auth is not None:
        weights["auth"] = auth
    return {
        "image": {"base_image": "x"},
        "weights": [weights],
        "runtime": {"start_commands": [command]},
    }


def _assume(arn: str) -> dict[str, str]:
    return {
        "auth_method": "AWS_ASSUME_ROLE",
        "aws_assume_role_arn": arn,
        "aws_assume_role_region": "us-east-1",
    }


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_source_s_role_is_assumed_with_the_credentials_found(
    agent: Agent, sts_s3: servers.SeaweedFS, tls: bool
) -> None:
    """``AWS_ASSUME_ROLE``: the platform's keys, which read nothing themselves, assume the role
    the spec names (STS reached where ``AWS_ENDPOINT_URL`` says, over https trusting
    ``AWS_CA_BUNDLE``), and the role's credentials read the source. Without ``auth`` the same
    keys are refused: what read the source was the role."""
    source = _seed(sts_s3, {"config.json": b'{"layers": 2}\n', "weights.bin": b"w" * 3000})
    mount = agent.node_root / "app/model"
    check = f"cat {mount}/config.json && wc -c < {mount}/weights.bin"
    env = _env(sts_s3, tls)
    result = agent.run_job(_job(source, _assume(ROLE), check), env=env)
    assert result.code == 0, result.text
    assert result.out.split() == ['{"layers":', "2}", "3000"]

    alone = agent.run_job(_job(source, None, "true"), env=env)
    assert alone.code == 3, alone.text
    assert "access denied" in alone.err


def test_a_role_that_may_not_be_assumed_fails_the_deploy_naming_it(
    agent: Agent, sts_s3: servers.SeaweedFS
) -> None:
    """A role whose trust policy does not allow the credentials fails staging at once, naming
    the role, the method and what to check, never a secret value; nothing is mounted and the
    command does not run."""
    source = _seed(sts_s3, {"config.json": b"{}"})
    ran = agent.root / "ran"
    result = agent.run_job(_job(source, _assume(NO_ROLE), f"touch {ran}"), env=_env(sts_s3))
    assert result.code == 3, result.text
    assert f"cannot assume the role {NO_ROLE} (AWS_ASSUME_ROLE)" in result.err
    assert "AccessDenied" in result.err and "trust policy allows sts:AssumeRole" in result.err
    assert PLATFORM["AWS_SECRET_ACCESS_KEY"] not in result.err
    assert not ran.exists() and not (agent.node_root / "app/model").exists()


def test_a_role_whose_sts_host_does_not_exist_fails_the_deploy_at_once(
    agent: Agent, sts_s3: servers.SeaweedFS, unknown_name: str
) -> None:
    """STS asked at a host that does not exist (the field's region mistyped, or an endpoint):
    staging fails at once naming the host and the role, rather than after the outage's wait
    (``BT_STORE_OUTAGE_SECONDS``), as a role STS refuses does."""
    source = _seed(sts_s3, {"config.json": b"{}"})
    env = {
        **_env(sts_s3),
        "AWS_ENDPOINT_URL_STS": f"http://{unknown_name}:8333",
        "BT_STORE_OUTAGE_SECONDS": "300",
    }
    started = time.monotonic()
    result = agent.run_job(_job(source, _assume(ROLE), "true"), env=env)
    assert result.code == 3, result.text
    assert time.monotonic() - started < 60, "not waited out as an outage"
    said = f"cannot assume the role {ROLE} (AWS_ASSUME_ROLE): the host {unknown_name} does not"
    assert said in result.err, result.err


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_source_s_role_is_assumed_with_a_web_identity_token(
    agent: Agent, sts_s3: servers.SeaweedFS, issuer: servers.OidcIssuer, tls: bool
) -> None:
    """``AWS_OIDC``: the role is assumed with the OIDC token in ``AWS_WEB_IDENTITY_TOKEN_FILE``
    (``AssumeRoleWithWebIdentity``), no keys given at all. A token the role does not trust (of
    another audience) fails the deploy naming the role and the method, never the token."""
    source = _seed(sts_s3, {"config.json": b'{"layers": 4}\n'})
    token = agent.root / "token"
    token.write_text(issuer.token("job-1"))
    no_keys = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}  # none inherited either
    env = {**sts_s3.client_env(tls), **no_keys, "AWS_WEB_IDENTITY_TOKEN_FILE": str(token)}
    auth = {"auth_method": "AWS_OIDC", "aws_oidc_role_arn": ROLE, "aws_oidc_region": "us-east-1"}
    mount = agent.node_root / "app/model"
    result = agent.run_job(_job(source, auth, f"cat {mount}/config.json"), env=env)
    assert result.code == 0, result.text
    assert result.out.split() == ['{"layers":', "4}"]

    other = issuer.token("job-1", audience="another-service")
    token.write_text(other)
    refused = agent.run_job(_job(source, auth, "true"), env=env)
    assert refused.code == 3, refused.text
    assert f"cannot assume the role {ROLE} (AWS_OIDC)" in refused.err
    assert "sts:AssumeRoleWithWebIdentity" in refused.err and other not in refused.err


def test_the_role_s_credentials_are_asked_for_again_before_they_expire(
    sts_s3: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is told when the role's credentials expire, and each time it asks within the
    15 minutes before (here: always, as the server's sessions last 14) the role is assumed
    again: a new session, whose credentials read as the first did. Its name is the job's, as
    AWS's logs (CloudTrail) show it."""
    for name, value in _env(sts_s3).items():
        monkeypatch.setenv(name, value)
    source = _seed(sts_s3, {"a.txt": b"a"})
    role = AwsRole(ROLE, "us-east-1", session_name="bt-agent-abc1234")
    store = open_store(source, Environ.current(), role=role)
    try:
        assert [info.key for info in store.list()] == ["a.txt"]
        provider = store._credentials
        assert isinstance(provider, RoleCredentials)
    finally:
        store.close()
    first, second = provider(), provider()
    assert first["expires_at"] is not None and second["expires_at"] is not None
    assert first["access_key_id"] != second["access_key_id"], "assumed once only"
    for credential in (first, second):
        sts = boto3.client(
            "sts",
            endpoint_url=sts_s3.endpoint,
            region_name="us-east-1",
            aws_access_key_id=credential["access_key_id"],
            aws_secret_access_key=credential["secret_access_key"],
            aws_session_token=credential["token"],
        )
        assert sts.get_caller_identity()["Arn"].endswith("assumed-role/Weights/bt-agent-abc1234")


def test_a_secret_s_keys_assume_the_role_where_the_source_names_both(
    sts_s3: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source with a secret (``auth_secret_name``) and a role: the secret's keys, not the
    environment's, are what the role is assumed with."""
    for name, value in sts_s3.client_env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # nothing to fall back on
        monkeypatch.delenv(name)
    source = _seed(sts_s3, {"a.txt": b"secret's"})
    secret = json.dumps(
        {
            "aws_access_key_id": PLATFORM["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": PLATFORM["AWS_SECRET_ACCESS_KEY"],
        }
    )
    with open_store(source, Environ.current(), secret, "s3", AwsRole(ROLE, "us-east-1")) as store:
        assert store.read_bytes("a.txt") == b"secret's"
    wrong = json.dumps({"aws_access_key_id": "nobody", "aws_secret_access_key": "x"})
    refused_store = open_store(source, Environ.current(), wrong, "s3", AwsRole(ROLE, "us-east-1"))
    with refused_store, pytest.raises(AccessDeniedError) as refused:
        refused_store.read_bytes("a.txt")
    assert f"cannot assume the role {ROLE}" in str(refused.value)


def test_a_role_session_is_named_for_the_job() -> None:
    """What STS takes in a session's name (``[\\w+=,.@-]``, up to 64); the web identity token's
    file from ``AWS_WEB_IDENTITY_TOKEN_FILE`` for ``AWS_OIDC``; no role for other methods."""
    environ = Environ({"AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"})

    def source(**auth: str) -> WeightsSource:
        method = WeightsAuthMethod(auth.pop("auth_method"))
        return WeightsSource("s3://b/p", "/m", auth=WeightsAuth(method, **auth))

    assumed = aws_role(source(**_assume(ROLE)), environ, "job 1/x")
    assert assumed == AwsRole(ROLE, "us-east-1", session_name="bt-agent-job-1-x")
    oidc = aws_role(
        source(auth_method="AWS_OIDC", aws_oidc_role_arn=ROLE, aws_oidc_region="eu-west-1"),
        environ,
        None,
    )
    assert oidc == AwsRole(ROLE, "eu-west-1", "AWS_OIDC", "bt-agent", "/var/run/token")
    assert oidc.web_identity and not assumed.web_identity
    custom = source(auth_method="CUSTOM_SECRET", auth_secret_name="s3")
    assert aws_role(custom, environ, "j") is None


@pytest.mark.parametrize("url", ["gs://bucket/model", "r2://acct.bucket/model", "hf://org/m"])
def test_a_role_for_a_source_other_than_s3_is_refused(url: str) -> None:
    with pytest.raises(UsageError) as refused:
        open_store(url, Environ({}), role=AwsRole(ROLE, "us-east-1"))
    said = str(refused.value)
    assert "auth_method AWS_ASSUME_ROLE assumes an AWS IAM role" in said
    assert "only s3:// sources take" in said and "CUSTOM_SECRET" in said


def test_aws_oidc_without_a_token_file_says_which_variable_to_set(
    sts_s3: servers.SeaweedFS, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``AWS_OIDC`` with no ``AWS_WEB_IDENTITY_TOKEN_FILE``, or one that names no file, is an
    error naming the role and the variable, not a request refused for want of credentials."""
    for name, value in _env(sts_s3).items():
        monkeypatch.setenv(name, value)
    source = _seed(sts_s3, {"a.txt": b"a"})
    for token_file, said in [
        (None, "set AWS_WEB_IDENTITY_TOKEN_FILE to the file of an OIDC token the role trusts"),
        (str(tmp_path / "absent"), "absent"),
    ]:
        role = AwsRole(ROLE, "us-east-1", "AWS_OIDC", token_file=token_file)
        store = open_store(source, Environ.current(), role=role)
        try:
            with pytest.raises(AccessDeniedError) as refused:
                store.list()
        finally:
            store.close()
        assert ROLE in str(refused.value) and said in str(refused.value)
