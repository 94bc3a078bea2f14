"""The checkpoint client the test tools share (exact_json.py, resume_tool.py): POST a body
to the guard's /v1/checkpoint as it is, never parsed or re-encoded (the exact text is what
some tests check). Not a tool itself: the tools import it, Python putting their own
directory first on sys.path. examples/guard_client.py is the client for users; it encodes
a JSON value, which would change the bytes these tests look at."""
import os
import sys
import urllib.request


def save_checkpoint(body: bytes) -> None:
    """Save ``body`` as this attempt's checkpoint; raise on any answer but 2xx."""
    request = urllib.request.Request(
        os.environ["SIDECAR_GUARD_URL"] + "/v1/checkpoint", method="POST", data=body,
        headers={"Authorization": "Bearer " + os.environ["SIDECAR_GUARD_TOKEN"],
                 "Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        print(f"checkpoint saved: {response.status}", file=sys.stderr)
