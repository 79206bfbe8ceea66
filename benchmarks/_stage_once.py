"""One staging run for benchmarks/staging.py, timed inside the process (after imports), so the
figure is the DEPLOYING phase itself. As ``bt-agent stage`` does, it keeps few malloc arenas
and starts the seeding of the engine's TLS random generator before its imports. Usage:
_stage_once.py SPEC NODE_ROOT -> prints seconds and the process's peak RSS."""

from __future__ import annotations

from bt_agent.memory import keep_few_arenas
from bt_agent.storage.tls_seed import seed_in_background

keep_few_arenas()
seed_in_background()

# ruff: noqa: E402  (the imports below load while the seeding goes on, as in the agent)
import io
import json
import sys
import time

from _common import vm_hwm_mib

from bt_agent.context import ContextInputs, resolve
from bt_agent.log import AgentLog
from bt_agent.secrets import Secrets
from bt_agent.settings import Environ
from bt_agent.spec.loader import load
from bt_agent.staging.weights import stage_job_weights


def main() -> None:
    spec = load(sys.argv[1])
    environ = Environ.current()
    context = resolve(ContextInputs(node_root=sys.argv[2]), environ, 1, 0, None)
    started = time.perf_counter()
    stage_job_weights(spec.job, context, environ, Secrets(), AgentLog(io.StringIO()))
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_rss_mib": vm_hwm_mib()}))


if __name__ == "__main__":
    main()
