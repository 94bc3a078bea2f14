#!/usr/bin/env python3
"""Test launcher (case F10): execs argv[1:] with SIGTERM, SIGINT and SIGHUP blocked and
SIGCHLD and SIGUSR1 ignored, as launchers written in Perl or Node, or a runtime thread that
spawns children, leave them. Linux keeps both the mask and SIG_IGN across exec (and
Python's own SIG_IGN of SIGPIPE is passed on too)."""
import os
import signal
import sys

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
os.execv(sys.argv[1], sys.argv[1:])
