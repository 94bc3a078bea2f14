"""Demo tool that hangs the way a headless browser stuck on a modal dialog does:
it ignores SIGTERM and never answers. Only the stage deadline and SIGKILL end it."""
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stdin.read()
print("waiting for a dialog that never closes", file=sys.stderr, flush=True)
while True:
    time.sleep(60)
