"""Operations: metrics, the health endpoints and their small HTTP server, the periodic
background services' shape, traces (tracing, its hooks, and otel behind the lazy seam),
retention, the operator's web view (web, web_templates/) and the reference receiver of
fenced side effects (fence, receiver).

Import rule: Imports only sidecar.protocol, sidecar.runtime and sidecar.storage; never the
worker's end, the caller's end or MCP.
"""
