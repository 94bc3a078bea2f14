#!/bin/sh
# Test tool: reports its work directory and what its HOME holds; payload {"mode": M}:
# "clean" leaves everything as it was, "write" leaves a file in HOME, "chmod" opens
# HOME to others, "child" leaves a process behind (the tree kill reaps it).
payload=$(cat)
seen=$(ls -A "$HOME" | tr '\n' ' ')
case "$payload" in
  *write*) echo secret > "$HOME/left-behind" ;;
  *chmod*) chmod 0755 "$HOME" ;;
  *child*) sleep 30 & ;;
esac
printf '{"dir": "%s", "home_had": "%s"}\n' "$SIDECAR_JOB_DIR" "$seen"
