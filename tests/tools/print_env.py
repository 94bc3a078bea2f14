#!/usr/bin/env python3
"""Test tool: reports the environment it was started with, for the secret-leak tests.

stdin: a JSON payload ``{"exit": N}``. N == 0: prints ``{"env": {NAME: VALUE, ...}}`` on stdout
(the job's result). Otherwise writes ``NAME=VALUE`` lines to stderr, the ``SIDECAR_*`` ones
last (so they stay in the stderr tail the sidecar keeps), and exits N.
"""
import json
import os
import sys

code = int(json.load(sys.stdin).get("exit", 0))
env = dict(os.environ)
if code == 0:
    json.dump({"env": env}, sys.stdout)
    sys.exit(0)
names = sorted(env, key=lambda name: (name.startswith("SIDECAR_"), name))
for name in names:
    sys.stderr.write(f"{name}={env[name]}\n")
sys.stderr.write("print_env: done\n")
sys.stderr.flush()
sys.exit(code)
