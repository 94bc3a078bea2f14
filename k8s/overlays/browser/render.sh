#!/bin/sh
# Payload {"url": "https://..."}; result {"url", "bytes", "sha256"} of the rendered DOM.
# Bad input (no url, another scheme) exits 65 with one line: never retried.
set -eu
url=$(sed -n 's/.*"url"[[:space:]]*:[[:space:]]*"\([^"\\]*\)".*/\1/p')
[ -n "$url" ] || { echo 'bad payload: must be {"url": "https://..."}' >&2; exit 65; }
# http and https only: a file:// URL would render the pod's own files (a mounted Secret),
# and a "URL" starting with - would be taken for a Chromium switch.
case "$url" in
  http://?*|https://?*) ;;
  *) echo "bad payload: 'url' must be http or https" >&2; exit 65 ;;
esac
case "$url" in
  *[[:space:][:cntrl:]]*) echo "bad payload: 'url' must not contain spaces" >&2; exit 65 ;;
esac
out=$(mktemp)
/headless-shell/headless-shell --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --no-first-run --disable-background-networking --disable-component-update \
  --disable-sync --user-data-dir="$HOME/chrome" --dump-dom "$url" > "$out"
printf '{"url": "%s", "bytes": %s, "sha256": "%s"}\n' \
  "$url" "$(wc -c < "$out")" "$(sha256sum "$out" | cut -d' ' -f1)"
rm -f "$out"
