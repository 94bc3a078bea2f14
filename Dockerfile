# syntax=docker/dockerfile:1
# The sidecar image: wheels are built in one stage, installed in a slim runtime stage.
# Wrap a tool by building FROM this image (or adding the tool to it) and running
#   sidecar run --tool TOOL -- /path/to/tool
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Numeric non-root user: Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
# tini is PID 1 and reaps; the sidecar drains on the SIGTERM tini forwards.
ENTRYPOINT ["/usr/bin/tini", "--", "sidecar"]
CMD ["run", "--help"]
