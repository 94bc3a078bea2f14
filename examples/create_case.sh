#!/bin/sh
# A tool that performs one irreversible side effect safely, in shell with curl.
#
# The sidecar gives every attempt SIDECAR_IDEMPOTENCY_KEY (stable across attempts) and
# SIDECAR_FENCING_TOKEN (grows with every claim). Derive one key per operation from the
# first, send the second as X-Execution-Fence: the receiver then replays a duplicate
# instead of acting twice, and refuses a late request from an owner that lost the job.
#
#   RECEIVER_URL=http://127.0.0.1:8900 SIDECAR_PROFILE_CREATE_CASE_ENV_PASSTHROUGH=PATH,RECEIVER_URL \
#     sidecar run --tool create-case -- examples/create_case.sh
#   sidecar enqueue create-case --payload '{"customer": "c-1048", "summary": "check invoice"}'
set -eu
receiver=${RECEIVER_URL:-http://127.0.0.1:8900}
answer=$(mktemp)
trap 'rm -f "$answer"' EXIT

# The payload (JSON on stdin) is the body of the effect.
status=$(curl --silent --show-error --max-time 30 --output "$answer" --write-out '%{http_code}' \
    --request POST "$receiver/effects" \
    --header 'Content-Type: application/json' \
    --header "Idempotency-Key: $SIDECAR_IDEMPOTENCY_KEY:create_case" \
    --header "X-Execution-Fence: $SIDECAR_FENCING_TOKEN" \
    --data-binary @-)

case "$status" in
    2??) printf '{"status": %s, "receiver": %s}\n' "$status" "$(cat "$answer")" ;;
    408|429|5??) echo "receiver busy ($status), the sidecar will retry" >&2; exit 75 ;;
    *) echo "receiver refused ($status): $(cat "$answer")" >&2; exit 65 ;;  # EX_DATAERR: final
esac
