# syntax=docker/dockerfile:1
# shared-svc container image: the package built from this repository's own files, its
# dependencies installed from requirements.lock (pinned, every file's hash checked).
#
#   docker build -t REGISTRY/shared-svc:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" .
#
# Stage 1 installs the locked dependencies and the shared-svc wheel into a venv without
# pip (/opt/venv); stage 2 copies that venv into the same slim Python, removes the base
# image's pip, and runs as a non-root user (uid 65532).
#
# The base image is pinned by digest (the multi-platform index of python:3.11-slim; the
# tag only documents it). To refresh it:
#   docker buildx imagetools inspect python:3.11-slim --format '{{json .Manifest.Digest}}'
# and put the digest here; when the Python minor version changes, also run `make lock`
# (requirements.lock records the Python it was made for; tests/test_packaging.py checks).
ARG PYTHON_IMAGE=python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY requirements.lock ./
RUN python -m venv --without-pip /opt/venv \
    && pip --python /opt/venv/bin/python install --no-deps --require-hashes -r requirements.lock
# The package only (what `shared-svc run`, `plan`, `upgrade` and the chart's `admission` hook
# Jobs run): the checkout's development package testenv/ (control plane, demo) and the tests
# stay out; tests/test_packaging.py checks the wheel's file list.
COPY pyproject.toml README.md ./
COPY shared_svc/ shared_svc/
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && pip --python /opt/venv/bin/python install --no-deps --no-index /wheels/shared_svc-*.whl \
    && pip --python /opt/venv/bin/python check

FROM ${PYTHON_IMAGE}
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="shared-svc" \
      org.opencontainers.image.description="Shared DCGM Services for gpu-operator, and GPU-consumer release during driver upgrades" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
RUN python -m pip uninstall --yes --quiet pip setuptools wheel \
    && groupadd --gid 65532 shared-svc \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin shared-svc
COPY --from=builder /opt/venv /opt/venv
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["shared-svc"]
CMD ["run"]
