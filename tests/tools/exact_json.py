#!/usr/bin/env python3
"""Test tool (case F11): copies the JSON text of the file argv[1] to stdout byte for byte,
never parsing it (a parse into floats is the fault under test). With argv[2] == "checkpoint"
the first attempt instead saves that text through the guard as its checkpoint and exits 3;
an attempt that has SIDECAR_CHECKPOINT_FILE prints the checkpoint's text."""
import os
import sys

from tool_checkpoint import save_checkpoint

sys.stdin.buffer.read()
checkpoint = os.environ.get("SIDECAR_CHECKPOINT_FILE")
if checkpoint:
    with open(checkpoint, "rb") as f:
        sys.stdout.buffer.write(f.read())
    sys.exit(0)
with open(sys.argv[1], "rb") as f:
    text = f.read()
if sys.argv[2:] != ["checkpoint"]:
    sys.stdout.buffer.write(text)
    sys.exit(0)
save_checkpoint(text)
sys.exit(3)
