# Bake bt-agent into a training base image. The agent lives in its own virtual environment under
# /opt/bt-agent, so the image's Python and the user's packages are untouched.
#
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime -t my-train .
#
# Loading a config.py needs the truss package in some Python: install it in the image's Python
# and set BT_CONFIG_PYTHON to it, or give the job as JSON (BT_JOB_SPEC=/path/job.json).
ARG BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

COPY pyproject.toml README.md /tmp/bt-agent-src/
COPY bt_agent /tmp/bt-agent-src/bt_agent
RUN python3 -m venv /opt/bt-agent \
    && /opt/bt-agent/bin/pip install --no-cache-dir /tmp/bt-agent-src \
    && rm -rf /tmp/bt-agent-src

COPY entrypoint.sh /usr/local/bin/bt-entrypoint
ENV BT_AGENT_BIN=/opt/bt-agent/bin/bt-agent
WORKDIR /b10/workspace
ENTRYPOINT ["/usr/local/bin/bt-entrypoint"]
