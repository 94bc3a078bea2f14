#!/usr/bin/env python3
"""Test tool (case F11 at the MCP edge, issue 41): its result is its payload, the JSON text
of stdin copied to stdout byte for byte, never parsed (a parse into floats is the fault
under test)."""
import sys

sys.stdout.buffer.write(sys.stdin.buffer.read())
