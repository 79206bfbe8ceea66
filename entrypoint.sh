#!/bin/sh
# The container's entrypoint: exec bt-agent so that it is PID 1 and receives the platform's
# SIGTERM directly. The spec comes from $BT_JOB_SPEC (or a path given as the first argument);
# every node-context input can be set through its BT_* variable (see `bt-agent run --help`).
set -eu
agent="${BT_AGENT_BIN:-/opt/bt-agent/bin/bt-agent}"
if [ ! -x "$agent" ]; then
    agent="$(command -v bt-agent || true)"
fi
if [ -z "$agent" ]; then
    echo "entrypoint: bt-agent not found; set BT_AGENT_BIN or install bt-agent" >&2
    exit 127
fi
if [ $# -eq 0 ] && [ -z "${BT_JOB_SPEC:-}" ]; then
    echo "entrypoint: no job spec: set BT_JOB_SPEC to the spec's path" >&2
    exit 2
fi
exec "$agent" run "$@"
