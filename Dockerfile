# syntax=docker/dockerfile:1
# extproc image: the locked runtime dependencies in a venv built with uv, copied into a slim
# runtime stage that runs as a non-root user. No dev group, no `envoy` extra (the Envoy
# binary runs in its own image). Build: see deploy/README.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ghcr.io/astral-sh/uv:0.9 AS uv

FROM ${PYTHON_IMAGE} AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/venv
WORKDIR /src
# Dependencies first, in their own layer: it is rebuilt only when the lock changes.
COPY pyproject.toml uv.lock ./
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-install-project --no-editable
COPY README.md ./
COPY extproc ./extproc
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --locked --no-dev --no-editable

FROM ${PYTHON_IMAGE} AS runtime
# The uid/gid match runAsUser/runAsGroup in deploy/base/deployment.yaml.
RUN groupadd --system --gid 10001 extproc \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin extproc
COPY --from=build /opt/venv /opt/venv
# The commit label of the build-info metric (llm_d_epp_info): `--build-arg EXTPROC_COMMIT=$(git rev-parse HEAD)`.
ARG EXTPROC_COMMIT=unknown
ENV EXTPROC_COMMIT=${EXTPROC_COMMIT} \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# ext_proc, gRPC health, Prometheus metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["extproc"]
CMD ["serve"]
