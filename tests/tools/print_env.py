#!/usr/bin/env python3
"""Test tool: reports the environment it was started with, for the secret-leak tests.

stdin: a JSON payload ``{"exit": N}``. N == 0: prints ``{"env": {NAME: VALUE, ...}}`` on stdout
(the job's result; SIDECAR_GUARD_TOKEN's value as ``(set)``). Otherwise writes
``NAME=VALUE`` lines to stderr, the ``SIDECAR_*`` ones last (so they stay in the stderr
tail the sidecar keeps), and exits N.
"""
import json
import os
import sys

code = int(json.load(sys.stdin).get("exit", 0))
env = dict(os.environ)
if code == 0:
    # The guard token is a secret of the sidecar's: echoed in a result it fails the
    # attempt (secret_in_output, issue 25); its presence is what is reported. On stderr
    # it stays, to be scrubbed from the tail and the log.
    json.dump({"env": {k: "(set)" if k == "SIDECAR_GUARD_TOKEN" else v
                       for k, v in env.items()}}, sys.stdout)
    sys.exit(0)
names = sorted(env, key=lambda name: (name.startswith("SIDECAR_"), name))
for name in names:
    sys.stderr.write(f"{name}={env[name]}\n")
sys.stderr.write("print_env: done\n")
sys.stderr.flush()
sys.exit(code)
