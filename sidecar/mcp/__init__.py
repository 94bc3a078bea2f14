"""The MCP gateway (``sidecar mcp``): the gateway on the MCP SDK (gateway), what it exposes and
to whom (catalog), and the client's side of MCP Tasks (tasks).

Import rule: Reaches jobs only through the caller's end (sidecar.client) and the store:
imports sidecar.protocol, sidecar.runtime, sidecar.storage and sidecar.client; never the
worker's end nor sidecar.ops.
"""
