#!/bin/sh
# Test tool: reports its work directory and what its HOME holds; payload {"mode": M}:
# "clean" leaves everything as it was, "write" leaves a file in HOME, "chmod" opens
# HOME to others, "child" leaves a process behind (the tree kill reaps it), "top" leaves
# a file in the work directory itself, "runtime" one in XDG_RUNTIME_DIR, "swap" renames
# the work directory away (to <dir>.old) and leaves an exact empty replica in its place.
payload=$(cat)
seen=$(ls -A "$HOME" | tr '\n' ' ')
case "$payload" in
  *write*) echo secret > "$HOME/left-behind" ;;
  *chmod*) chmod 0755 "$HOME" ;;
  *child*) sleep 30 & ;;
  *top*) echo x > "$SIDECAR_JOB_DIR/left-behind" ;;
  *runtime*) echo x > "$XDG_RUNTIME_DIR/left-behind" ;;
  *swap*) mv "$SIDECAR_JOB_DIR" "$SIDECAR_JOB_DIR.old" &&
          mkdir -m 700 "$SIDECAR_JOB_DIR" "$SIDECAR_JOB_DIR/h" "$SIDECAR_JOB_DIR/r" ;;
esac
printf '{"dir": "%s", "home_had": "%s"}\n' "$SIDECAR_JOB_DIR" "$seen"
