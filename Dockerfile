# syntax=docker/dockerfile:1
# shared-svc container image: the package built from this repository's own files.
#
#   docker build -t REGISTRY/shared-svc:0.1.0 .
#
# Stage 1 builds wheels of shared-svc and its dependencies; stage 2 installs them into a
# slim Python with no build tools and runs as a non-root user (uid 65532).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared_svc/ shared_svc/
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels shared-svc \
    && groupadd --gid 65532 shared-svc \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin shared-svc
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["shared-svc"]
CMD ["run"]
