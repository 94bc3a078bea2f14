"""The worker's end: ``sidecar run`` from its arguments (bootstrap) to the claim loop
(claim_loop), one job's supervisor, the fenced commit, the lease keeper, the child process,
its sandbox (isolation, cgroups, linux, safefs), the guard API, the guardian, progress
reports, leftovers and the result forwarder.

Import rule: Imports sidecar.protocol, sidecar.runtime, sidecar.storage and sidecar.ops;
never the caller's end (sidecar.client) nor MCP. This __init__ imports nothing: ``python -m
sidecar.worker.guardian`` stays small.
"""
