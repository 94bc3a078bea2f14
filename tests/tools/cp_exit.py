#!/usr/bin/env python3
"""Test tool: never reads stdin; writes one stderr line naming its attempt, exits with CODE.

argv: CODE.
"""
import os
import sys

code = int(sys.argv[1])
sys.stderr.write(f"cp_exit: attempt {os.environ.get('SIDECAR_ATTEMPT')} exits with {code}\n")
sys.stderr.flush()
os._exit(code)
