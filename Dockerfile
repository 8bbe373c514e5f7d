# syntax=docker/dockerfile:1
# Two images from one file, each installed through the project's own extras (the recipe CI runs):
#   docker build --target operator -t lorajob-operator .    kopf operator; no JAX
#   docker build --target trainer  -t lorajob-trainer .     convert/train/export entry points; JAX on CPU
#   docker build --target trainer --build-arg JAX_PLATFORM=tpu -t lorajob-trainer:tpu .   (or cuda12)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# A fixed numeric non-root user, so Kubernetes can verify runAsNonRoot without a passwd lookup.
ARG UID=65532

# --- build stages: a virtualenv under /opt/venv, copied into the runtime stages without pip's caches
FROM ${PYTHON_IMAGE} AS source
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/lorajob_operator/ operator/lorajob_operator/
COPY trainer/lorajob_trainer/ trainer/lorajob_trainer/
COPY devcluster/lorajob_devcluster/ devcluster/lorajob_devcluster/
RUN python -m venv /opt/venv

FROM source AS operator-build
RUN /opt/venv/bin/pip install ".[operator]" \
    && if /opt/venv/bin/python -c "import jax" 2>/dev/null; then echo "the operator image must not contain JAX" >&2; exit 1; fi

FROM source AS trainer-build
# cpu (default), tpu or cuda12: the jax extra that selects the accelerator plugin.
ARG JAX_PLATFORM=cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN /opt/venv/bin/pip install ".[trainer]" \
    && if [ "${JAX_PLATFORM}" != "cpu" ]; then \
         jax_version="$(/opt/venv/bin/python -c 'import importlib.metadata as m; print(m.version("jax"))')"; \
         /opt/venv/bin/pip install "jax[${JAX_PLATFORM}]==${jax_version}"; \
       fi \
    && if /opt/venv/bin/python -c "import torch" 2>/dev/null; then echo "the trainer image must not contain torch" >&2; exit 1; fi

# --- runtime stages
FROM ${PYTHON_IMAGE} AS runtime
ARG UID
RUN groupadd --gid "${UID}" lorajob \
    && useradd --uid "${UID}" --gid "${UID}" --no-create-home --home-dir /tmp --shell /usr/sbin/nologin lorajob
# Bytecode is compiled at install time; nothing is written next to the code at run time, so the
# root filesystem can be mounted read-only (the chart gives /tmp an emptyDir).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /tmp

FROM runtime AS operator
ARG UID
COPY --from=operator-build /opt/venv /opt/venv
USER ${UID}:${UID}
EXPOSE 8080
ENTRYPOINT ["python", "-m", "lorajob_operator"]

FROM runtime AS trainer
ARG UID
COPY --from=trainer-build /opt/venv /opt/venv
USER ${UID}:${UID}
# No entry point: the operator sets each step's command (python -m lorajob_trainer.<convert|train|export>).
