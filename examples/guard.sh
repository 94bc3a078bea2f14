#!/bin/sh
# Ask the sidecar's guard, just before an irreversible step, whether this attempt may act.
#
#   examples/guard.sh [REQUEST_ID]
#
# Prints the guard's answer, e.g. {"fencing_token":3,"lease_remaining_seconds":71.204}, and
# exits 0: go ahead, and send the token as X-Execution-Fence. Exits 1 with the reason on
# stderr when the guard says no (409): cancelled, lease_lost, ownership_unknown, deadline or
# lease_ending (only lease_ending is worth a retry after a second or two). Exits 2 when the
# guard cannot be asked (not run by a sidecar, 401, unreachable). Without SIDECAR_GUARD_URL
# (a sandbox with NETWORK=none) it asks over the attempt's own Unix socket,
# SIDECAR_GUARD_SOCKET.
#
# REQUEST_ID (optional, 1-200 characters) names the external request you are about to send;
# the sidecar logs it if ownership becomes unknown while it is in flight (P15). Use a
# stable one, e.g. "$SIDECAR_IDEMPOTENCY_KEY:create_case".
#
# In a tool:
#   answer=$(examples/guard.sh "$SIDECAR_IDEMPOTENCY_KEY:create_case") || exit 75
#
# Saving progress for the next attempt (one JSON value, at most 64 KiB) is one curl call:
#   curl -sS --noproxy '*' -H "Authorization: Bearer $SIDECAR_GUARD_TOKEN" \
#        -H 'Content-Type: application/json' --data-binary @progress.json \
#        "$SIDECAR_GUARD_URL/v1/checkpoint"
set -eu
if [ -z "${SIDECAR_GUARD_URL:-}${SIDECAR_GUARD_SOCKET:-}" ] || [ -z "${SIDECAR_GUARD_TOKEN:-}" ]; then
    echo "guard: SIDECAR_GUARD_URL (or SIDECAR_GUARD_SOCKET) and SIDECAR_GUARD_TOKEN are not set (not run by a sidecar?)" >&2
    exit 2
fi
where=${SIDECAR_GUARD_URL:-$SIDECAR_GUARD_SOCKET}
url=${SIDECAR_GUARD_URL:-http://localhost}
ask() {  # curl, over the attempt's own socket when there is no loopback URL
    if [ -n "${SIDECAR_GUARD_URL:-}" ]; then
        curl "$@"
    else
        curl --unix-socket "$SIDECAR_GUARD_SOCKET" "$@"
    fi
}
body=''
if [ $# -gt 0 ]; then
    # JSON string escaping for the two characters that need it in a plain id.
    id=$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')
    body="{\"request_id\": \"$id\"}"
fi
answer=$(mktemp)
trap 'rm -f "$answer"' EXIT

# --noproxy: the guard is on 127.0.0.1; an http_proxy setting must not divert the call.
# The secret goes in a header read from stdin, so it never shows in `ps`.
status=$(printf 'Authorization: Bearer %s\n' "$SIDECAR_GUARD_TOKEN" |
    ask --silent --show-error --noproxy '*' --max-time 10 \
        --output "$answer" --write-out '%{http_code}' \
        --request POST "$url/v1/guard" \
        --header @- --header 'Content-Type: application/json' \
        --data-binary "$body") || status=000

case "$status" in
    200) cat "$answer"; echo ;;
    409) reason=$(sed -n 's/.*"reason" *: *"\([a-z_]*\)".*/\1/p' "$answer")
         echo "guard: ${reason:-refused}" >&2; exit 1 ;;
    000) echo "guard: $where unreachable" >&2; exit 2 ;;
    *)   echo "guard: answered $status: $(cat "$answer")" >&2; exit 2 ;;
esac
