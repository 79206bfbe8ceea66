"""Secrets kept: a job that uses secrets everywhere a spec can (an environment variable, the
credentials of an S3 weights source, right and wrong) and checkpoints; then everything the agent
produced is scanned for the secret values: stdout, stderr, every object in the store (records,
logs, manifests), the node's journal, and `bt-agent env` and `jobs view` output. Zero
occurrences allowed."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import servers
from helpers import Agent

TOKEN = f"hf_{uuid.uuid4().hex}SECRETTOKEN"
WRONG_KEY = f"wrong{uuid.uuid4().hex}SECRETKEY"


def _everything(agent: Agent, *texts: str) -> bytes:
    parts = [t.encode() for t in texts]
    for root in (agent.store, agent.node_root / "var"):
        parts += [p.read_bytes() for p in root.rglob("*") if p.is_file()]
    return b"\n".join(parts)


def _seed(server: servers.SeaweedFS) -> str:
    bucket = f"sec{uuid.uuid4().hex[:10]}"
    server.create_bucket(bucket)
    server.client().put_object(Bucket=bucket, Key="w/config.json", Body=b"{}")
    return f"s3://{bucket}/w"


def _job(source: str, secret: str, command: str) -> dict[str, object]:
    return {
        "image": {"base_image": "x"},
        "weights": [{"source": source, "mount_location": "/app/w", "auth_secret_name": secret}],
        "runtime": {
            "start_commands": [command],
            "environment_variables": {"HF_TOKEN": {"name": "hf_token"}},
            "checkpointing_config": {"enabled": True},
        },
    }


def test_secret_values_never_leave_the_child(agent: Agent, s3_server: servers.SeaweedFS) -> None:
    agent.secret("hf_token", TOKEN)
    agent.secret(
        "good_keys",
        json.dumps(
            {"aws_access_key_id": servers.ACCESS_KEY, "aws_secret_access_key": servers.SECRET_KEY}
        ),
    )
    agent.secret(
        "bad_keys",
        json.dumps({"aws_access_key_id": "AKIAWRONG", "aws_secret_access_key": WRONG_KEY}),
    )
    source = _seed(s3_server)
    env = {"AWS_ENDPOINT_URL": s3_server.endpoint, "BT_CHECKPOINT_QUIET_SECONDS": "0.2"}
    command = (
        'echo "token $HF_TOKEN" && echo "$HF_TOKEN" >&2 && mkdir -p $BT_CHECKPOINT_DIR/checkpoint-1'
        " && echo state > $BT_CHECKPOINT_DIR/checkpoint-1/state.txt"
    )
    good = agent.run_job(_job(source, "good_keys", command), "--job-id", "sec0001", env=env)
    assert good.code == 0, good.text
    assert "token ***" in good.out
    bad = agent.run_job(_job(source, "bad_keys", "true"), "--job-id", "sec0002", env=env)
    assert bad.code == 3 and "access denied" in bad.err, bad.text
    spec = agent.spec(_job(source, "good_keys", command), name="env.json")
    shown = agent("env", str(spec), *agent.context_args())
    assert shown.code == 0, shown.text
    view = agent("jobs", "view", "sec0001", "--store", str(agent.store), "-o", "json")
    logs = agent("jobs", "logs", "sec0001", "--store", str(agent.store))
    produced = _everything(
        agent, good.out, good.err, bad.out, bad.err, shown.out, shown.err, view.out, logs.out
    )
    for value in (TOKEN, servers.SECRET_KEY, WRONG_KEY):
        assert value.encode() not in produced, f"a secret value leaked: {value[:6]}..."
    assert b"hf_token" in produced and b"good_keys" in produced  # the names are kept
    assert Path(agent.node_root / "app/w/config.json").read_bytes() == b"{}"


def _pem(rng_seed: str) -> str:
    import base64
    import hashlib

    body = b"".join(hashlib.sha512(f"{rng_seed}{i}".encode()).digest() for i in range(20))
    text = base64.b64encode(body).decode()
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return "\n".join(["-----BEGIN PRIVATE KEY-----", *lines, "-----END PRIVATE KEY-----"])


LEAKY_TRAINER = r"""
import json, os, sys
key, account, token = os.environ["TLS_KEY"], os.environ["SERVICE_ACCOUNT"], os.environ["TOKEN"]
print(key)                                   # a PEM key, line by line
print(account)                               # a service-account JSON, pretty-printed
print(json.loads(account)["private_key"])    # the key inside it, unescaped
print(json.loads(account)["private_key_id"])
print(repr(key), json.dumps(key))            # escaped forms
print(repr(account))
for stream in (sys.stdout, sys.stderr):      # a value across the 64 KiB read boundary
    stream.write("x" * (64 * 1024 - 7) + token + " tail\n")
    stream.flush()
print("done", flush=True)
"""


def test_multiline_secrets_and_values_across_reads_are_masked(agent: Agent) -> None:
    from helpers import trainer_job

    key = _pem("tls")
    inner = _pem("service-account")
    account = json.dumps(
        {
            "type": "service_account",
            "private_key_id": uuid.uuid4().hex + "a1b2c3d4",
            "private_key": inner + "\n",
            "client_email": "trainer@example-project.iam.gserviceaccount.com",
        },
        indent=2,
    )
    token = f"tok_{uuid.uuid4().hex}"
    agent.secret("tls_key", key)
    agent.secret("service_account", account)
    agent.secret("token", token)
    job = trainer_job(agent, LEAKY_TRAINER)
    job["runtime"]["checkpointing_config"] = {"enabled": False}
    job["runtime"]["environment_variables"] = {
        "TLS_KEY": {"name": "tls_key"},
        "SERVICE_ACCOUNT": {"name": "service_account"},
        "TOKEN": {"name": "token"},
    }
    result = agent.run_job(job, "--job-id", "sec0003")
    assert result.code == 0, result.text[-3000:]
    assert result.out.rstrip().endswith("done")
    logs = agent("jobs", "logs", "sec0003", "--store", str(agent.store))
    produced = _everything(agent, result.out, result.err, logs.out)
    secret_lines = [
        line for text in (key, inner) for line in text.splitlines() if not line.startswith("-----")
    ]
    values = [
        *secret_lines,
        token,
        json.loads(account)["private_key_id"],
        json.dumps(key)[1:-1],
        repr(account)[1:-1][:200],
    ]
    for value in values:
        assert value.encode() not in produced, f"a secret leaked: {value[:12]}..."
    assert result.out.count("***") >= len(secret_lines)
