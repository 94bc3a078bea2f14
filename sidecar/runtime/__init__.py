"""What every process of the sidecar runs on: settings and lease profiles from the environment
(config), the structured log (log), the event loop (loop) and the operator's bearer-token
files (tokens).

Import rule: Imports only sidecar.protocol.
"""
