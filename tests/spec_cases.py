"""Job specs, valid and invalid, with the field path each invalid one must report.

Shared by the spec tests (through the loader and through the CLI) and the SDK parity test.
"""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {"image": {"base_image": "pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime"}}


def job(**fields: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data.update(fields)
    return data


def weights(**fields: Any) -> dict[str, Any]:
    return job(
        weights=[{"source": "hf://Qwen/Qwen3-0.6B", "mount_location": "/app/models/q", **fields}]
    )


# The REFERENCE.md §1 example, on the wire.
FULL_EXAMPLE: dict[str, Any] = {
    "image": {"base_image": "pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime", "docker_auth": None},
    "compute": {
        "node_count": 2,
        "cpu_count": 8,
        "memory": "64Gi",
        "accelerator": {"accelerator": "H100", "count": 8},
        "availability_model": "dedicated",
    },
    "runtime": {
        "start_commands": ["chmod +x ./run.sh && ./run.sh"],
        "environment_variables": {"HELLO": "WORLD", "HF_TOKEN": {"name": "hf_access_token"}},
        "enable_cache": None,
        "checkpointing_config": {"enabled": True, "checkpoint_path": None, "volume_size_gib": 500},
        "load_checkpoint_config": {
            "enabled": True,
            "checkpoints": [
                {"typ": "baseten_latest_checkpoint", "job_id": None, "project_name": "my-proj"},
                {
                    "typ": "baseten_named_checkpoint",
                    "checkpoint_name": "checkpoint-20",
                    "job_id": "gvpql31",
                },
            ],
            "download_folder": "/tmp/loaded_checkpoints",
        },
        "cache_config": {
            "enabled": True,
            "enable_legacy_hf_mount": False,
            "require_cache_affinity": True,
            "mount_base_path": "/root/.cache",
        },
        "artifacts": [{"s3_bucket": "b", "s3_key": "k"}],
    },
    "interactive_session": None,
    "name": "fine-tune-v1",
    "priority": None,
    "workspace": None,
    "weights": [
        {
            "source": "hf://Qwen/Qwen3-0.6B@main",
            "mount_location": "/app/models/qwen",
            "auth": {"auth_method": "CUSTOM_SECRET", "auth_secret_name": "hf_access_token"},
            "auth_secret_name": None,
            "allow_patterns": ["*.safetensors", "config.json"],
            "ignore_patterns": ["*.md"],
        },
        {
            "source": "r2://acct123.my-bucket/data",
            "mount_location": "/app/data",
            "auth": None,
            "auth_secret_name": "r2_credentials",
            "allow_patterns": None,
            "ignore_patterns": None,
        },
    ],
    "enable_baseten_workdir": True,
}

VALID: dict[str, dict[str, Any]] = {
    "minimal": job(),
    "reference-example": FULL_EXAMPLE,
    "accelerator-string": job(compute={"accelerator": "H100"}),
    "accelerator-string-count": job(compute={"accelerator": "H100:8"}),
    "accelerator-count-as-string": job(
        compute={"accelerator": {"accelerator": "A100", "count": "8"}}
    ),
    "accelerator-null": job(compute={"accelerator": None}),
    "spot": job(compute={"availability_model": "spot"}),
    "secret-env": job(runtime={"environment_variables": {"T": {"name": "tok"}}}),
    "enable-cache-legacy": job(runtime={"enable_cache": True}),
    "cache-config": job(runtime={"cache_config": {"enabled": True}}),
    "latest-no-args": job(
        runtime={"load_checkpoint_config": {"enabled": True, "checkpoints": [{}]}}
    ),
    "load-default-checkpoints": job(runtime={"load_checkpoint_config": {"enabled": True}}),
    "latest-by-job": job(
        runtime={
            "load_checkpoint_config": {
                "enabled": True,
                "checkpoints": [{"typ": "baseten_latest_checkpoint", "job_id": "abc1234"}],
            }
        }
    ),
    "named-without-typ": job(  # the SDK's union takes the kind whose fields it has
        runtime={
            "load_checkpoint_config": {
                "enabled": True,
                "checkpoints": [{"checkpoint_name": "checkpoint-10", "job_id": "abc1234"}],
            }
        }
    ),
    "named": job(
        runtime={
            "load_checkpoint_config": {
                "enabled": True,
                "checkpoints": [
                    {
                        "typ": "baseten_named_checkpoint",
                        "checkpoint_name": "checkpoint-10",
                        "job_id": "abc1234",
                    }
                ],
                "download_folder": "/data/loaded",
            }
        }
    ),
    "custom-checkpoint-path": job(
        runtime={
            "checkpointing_config": {
                "enabled": True,
                "checkpoint_path": "/tmp/training_checkpoints",
            }
        }
    ),
    "weights-extra-key": weights(some_future_key=1),
    "weights-auth-lowercase": weights(
        auth={"auth_method": "custom_secret", "auth_secret_name": "hf"}
    ),
    "weights-aws-oidc": job(
        weights=[
            {
                "source": "s3://bucket/path",
                "mount_location": "/d",
                "auth": {
                    "auth_method": "AWS_OIDC",
                    "aws_oidc_role_arn": "arn:aws:iam::1:role/r",
                    "aws_oidc_region": "us-east-1",
                },
            }
        ]
    ),
    "weights-gcp-oidc": job(
        weights=[
            {
                "source": "gs://bucket/p",
                "mount_location": "/d",
                "auth": {
                    "auth_method": "GCP_OIDC",
                    "gcp_oidc_service_account": "sa",
                    "gcp_oidc_workload_id_provider": "p",
                },
            }
        ]
    ),
    "weights-assume-role": job(
        weights=[
            {
                "source": "s3://b/p",
                "mount_location": "/d",
                "auth": {
                    "auth_method": "AWS_ASSUME_ROLE",
                    "aws_assume_role_arn": "arn",
                    "aws_assume_role_region": "us-east-1",
                },
            }
        ]
    ),
    "s3-bucket-only": job(weights=[{"source": "s3://bucket", "mount_location": "/d"}]),
    "azure-and-cw": job(
        weights=[
            {"source": "azure://acct/container/p", "mount_location": "/a"},
            {"source": "cw://bucket/p", "mount_location": "/b"},
        ]
    ),
    "https": job(weights=[{"source": "https://example.com/model.bin", "mount_location": "/m"}]),
    "hf-revision": weights(source="hf://owner/repo@v1.0"),
    "bt-references": job(
        weights=[
            {"source": "bt://gvpql31/latest", "mount_location": "/app/latest"},
            {"source": "bt://gvpql31/checkpoint-20?rank=1", "mount_location": "/app/shard"},
        ]
    ),
    "interactive": job(interactive_session={"trigger": "on_startup", "timeout_minutes": 60}),
    "workspace": job(workspace={"workspace_root": "..", "exclude_dirs": ["data"]}),
    "priority": job(priority=5, enable_baseten_workdir=False),
}

# (job, field path that must be reported). Each one is wrong in exactly one way.
INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "image-missing": ({"runtime": {}}, "image"),
    "base-image-missing": (job(image={}), "image.base_image"),
    "unknown-top-field": (job(runtim={}), "runtim"),
    "unknown-runtime-field": (job(runtime={"start_command": ["x"]}), "runtime.start_command"),
    "node-count-string": (job(compute={"node_count": "2"}), "compute.node_count"),
    "node-count-float": (job(compute={"node_count": 2.0}), "compute.node_count"),
    "node-count-zero": (job(compute={"node_count": 0}), "compute.node_count"),
    "cpu-count-bool": (job(compute={"cpu_count": True}), "compute.cpu_count"),
    "memory-int": (job(compute={"memory": 2}), "compute.memory"),
    "accelerator-unknown": (job(compute={"accelerator": "H1000"}), "compute.accelerator"),
    "accelerator-bad-count": (job(compute={"accelerator": "H100:x"}), "compute.accelerator"),
    "accelerator-negative": (
        job(compute={"accelerator": {"accelerator": "H100", "count": -1}}),
        "compute.accelerator.count",
    ),
    "availability-unknown": (
        job(compute={"availability_model": "cheap"}),
        "compute.availability_model",
    ),
    "start-commands-string": (
        job(runtime={"start_commands": "python train.py"}),
        "runtime.start_commands",
    ),
    "start-command-int": (job(runtime={"start_commands": [1]}), "runtime.start_commands[0]"),
    "env-int": (
        job(runtime={"environment_variables": {"A": 1}}),
        "runtime.environment_variables.A",
    ),
    "env-secret-typo": (
        job(runtime={"environment_variables": {"A": {"nam": "x"}}}),
        "runtime.environment_variables.A.nam",
    ),
    "both-cache-settings": (
        job(runtime={"enable_cache": True, "cache_config": {"enabled": True}}),
        "runtime.enable_cache",
    ),
    "cache-enabled-string": (
        job(runtime={"cache_config": {"enabled": "yes"}}),
        "runtime.cache_config.enabled",
    ),
    "checkpoint-typ-unknown": (
        job(
            runtime={
                "load_checkpoint_config": {"enabled": True, "checkpoints": [{"typ": "latest"}]}
            }
        ),
        "runtime.load_checkpoint_config.checkpoints[0]",
    ),
    "named-missing-job": (
        job(
            runtime={
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [{"typ": "baseten_named_checkpoint", "checkpoint_name": "c"}],
                }
            }
        ),
        "runtime.load_checkpoint_config.checkpoints[0].job_id",
    ),
    "named-bad-name": (
        job(
            runtime={
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [
                        {
                            "typ": "baseten_named_checkpoint",
                            "checkpoint_name": "../x",
                            "job_id": "j",
                        }
                    ],
                }
            }
        ),
        "runtime.load_checkpoint_config.checkpoints[0].checkpoint_name",
    ),
    "loops-unsupported": (
        job(
            runtime={
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [
                        {"typ": "loops_checkpoint", "run_id": "r", "checkpoint_name": "c"}
                    ],
                }
            }
        ),
        "runtime.load_checkpoint_config.checkpoints[0].typ",
    ),
    "checkpointing-enabled-string": (
        job(runtime={"checkpointing_config": {"enabled": "true"}}),
        "runtime.checkpointing_config.enabled",
    ),
    "volume-size-string": (
        job(runtime={"checkpointing_config": {"volume_size_gib": "500"}}),
        "runtime.checkpointing_config.volume_size_gib",
    ),
    "source-no-scheme": (weights(source="Qwen/Qwen3"), "weights[0].source"),
    "source-bad-scheme": (weights(source="ftp://host/x"), "weights[0].source"),
    "s3-no-bucket": (weights(source="s3:///path"), "weights[0].source"),
    "s3-revision": (weights(source="s3://bucket/path@v1"), "weights[0].source"),
    "azure-no-container": (weights(source="azure://account"), "weights[0].source"),
    "r2-no-account": (weights(source="r2://bucket/path"), "weights[0].source"),
    "s3-bucket-with-space": (weights(source="s3://my bucket/path"), "weights[0].source"),
    "azure-container-with-space": (
        weights(source="azure://acct/my container/p"),
        "weights[0].source",
    ),
    "hf-path-inside-the-repo": (weights(source="hf://org/model/sub@main"), "weights[0].source"),
    "s3-path-climbs": (weights(source="s3://bucket/a/../b"), "weights[0].source"),
    "https-no-host": (weights(source="https://a b/x"), "weights[0].source"),
    "hf-empty": (weights(source="hf://"), "weights[0].source"),
    "https-empty": (weights(source="https://"), "weights[0].source"),
    "source-empty": (weights(source=""), "weights[0].source"),
    "bt-no-checkpoint": (weights(source="bt://gvpql31"), "weights[0].source"),
    "bt-nested-name": (weights(source="bt://gvpql31/a/b"), "weights[0].source"),
    "bt-bad-rank": (weights(source="bt://gvpql31/latest?rank=-1"), "weights[0].source"),
    "bt-unknown-parameter": (weights(source="bt://gvpql31/latest?node=1"), "weights[0].source"),
    "mount-relative": (weights(mount_location="models/q"), "weights[0].mount_location"),
    "mount-missing": ({**job(), "weights": [{"source": "hf://a/b"}]}, "weights[0].mount_location"),
    "auth-method-unknown": (
        weights(auth={"auth_method": "PASSWORD"}),
        "weights[0].auth.auth_method",
    ),
    "auth-secret-missing": (
        weights(auth={"auth_method": "CUSTOM_SECRET"}),
        "weights[0].auth.auth_secret_name",
    ),
    "auth-oidc-missing-region": (
        weights(auth={"auth_method": "AWS_OIDC", "aws_oidc_role_arn": "arn"}),
        "weights[0].auth.aws_oidc_region",
    ),
    "auth-forbidden-field": (
        weights(
            auth={"auth_method": "CUSTOM_SECRET", "auth_secret_name": "s", "aws_oidc_region": "us"}
        ),
        "weights[0].auth.aws_oidc_region",
    ),
    "auth-secret-twice": (
        weights(
            auth_secret_name="a", auth={"auth_method": "CUSTOM_SECRET", "auth_secret_name": "b"}
        ),
        "weights[0].auth_secret_name",
    ),
    "patterns-string": (weights(allow_patterns="*.safetensors"), "weights[0].allow_patterns"),
    "mount-duplicate": (
        job(
            weights=[
                {"source": "hf://a/b", "mount_location": "/app/m"},
                {"source": "hf://c/d", "mount_location": "/app/m/"},
            ]
        ),
        "weights[1].mount_location",
    ),
    "mount-nested": (
        job(
            weights=[
                {"source": "hf://a/b", "mount_location": "/app/m"},
                {"source": "hf://c/d", "mount_location": "/app/m/sub"},
            ]
        ),
        "weights[1].mount_location",
    ),
    "mount-in-checkpoint-dir": (
        weights(mount_location="/mnt/ckpts/base"),
        "weights[0].mount_location",
    ),
    "mount-over-workdir": (weights(mount_location="/b10"), "weights[0].mount_location"),
    "mount-system-dir": (weights(mount_location="/proc/x"), "weights[0].mount_location"),
    "mount-root": (weights(mount_location="/"), "weights[0].mount_location"),
    "download-in-checkpoint-dir": (
        job(
            runtime={
                "checkpointing_config": {"enabled": True, "checkpoint_path": "/ckpt"},
                "load_checkpoint_config": {"enabled": True, "download_folder": "/ckpt/loaded"},
            }
        ),
        "runtime.load_checkpoint_config.download_folder",
    ),
    "checkpoint-path-relative": (
        job(runtime={"checkpointing_config": {"checkpoint_path": "ckpts"}}),
        "runtime.checkpointing_config.checkpoint_path",
    ),
    "checkpoint-path-in-scratch": (
        job(runtime={"checkpointing_config": {"checkpoint_path": "/mnt/bt-scratch/c"}}),
        "runtime.checkpointing_config.checkpoint_path",
    ),
    "duplicate-named-reference": (
        job(
            runtime={
                "load_checkpoint_config": {
                    "enabled": True,
                    "checkpoints": [
                        {"typ": "baseten_named_checkpoint", "checkpoint_name": "c", "job_id": "j"},
                        {"typ": "baseten_named_checkpoint", "checkpoint_name": "c", "job_id": "j"},
                    ],
                }
            }
        ),
        "runtime.load_checkpoint_config.checkpoints[1]",
    ),
    "interactive-trigger": (
        job(interactive_session={"trigger": "always"}),
        "interactive_session.trigger",
    ),
    "priority-string": (job(priority="high"), "priority"),
    "workdir-flag-string": (job(enable_baseten_workdir="true"), "enable_baseten_workdir"),
    "weights-not-list": (job(weights={"source": "hf://a/b"}), "weights"),
}

# Mistakes the SDK lets through and bt-agent reports (excluded from the parity test's "agree").
# Valid specs the SDK refuses: our extensions (bt:// weights sources, REFERENCE.md §1).
EXTENSIONS = {"bt-references"}

OURS_ONLY = {
    "node-count-zero",
    "named-bad-name",
    "loops-unsupported",
    "mount-duplicate",
    "mount-nested",
    "mount-in-checkpoint-dir",
    "mount-over-workdir",
    "mount-system-dir",
    "mount-root",
    "download-in-checkpoint-dir",
    "checkpoint-path-relative",
    "checkpoint-path-in-scratch",
    "duplicate-named-reference",
    "azure-no-container",
    "r2-no-account",
    "s3-bucket-with-space",
    "azure-container-with-space",
    "hf-path-inside-the-repo",
    "s3-path-climbs",
    "https-no-host",
}
