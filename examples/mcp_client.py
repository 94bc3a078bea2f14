#!/usr/bin/env python3
"""Call one tool through `sidecar mcp` with the official MCP SDK's client, printing the
tool's progress as it comes, then its result (docs/mcp.md).

    MCP_URL=http://127.0.0.1:8765/mcp MCP_TOKEN=... \\
        python examples/mcp_client.py ocr '{"file": "/data/scan.png"}'

Exit 0 when the tool succeeded, 3 when its job failed or was cancelled (its error on
stderr), 2 for bad arguments.
"""

import asyncio
import json
import os
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


async def call(url: str, token: str, tool: str, arguments: dict) -> int:
    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        shown = f"{progress:.0%}" if total == 1 else f"report {progress:g}"
        print(f"progress: {shown} {message or ''}".rstrip(), file=sys.stderr)

    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with Client(streamable_http_client(url, http_client=http)) as client:
        result = await client.call_tool(tool, arguments, progress_callback=on_progress)
    job = (result.meta or {}).get("io.github.sidecar/job", {})
    if result.is_error:
        print(f"{tool} failed (job {job.get('id')}): {result.content[0].text}",
              file=sys.stderr)
        return 3
    print(json.dumps(result.structured_content
                     if result.structured_content is not None
                     else json.loads(result.content[0].text)))
    return 0


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: mcp_client.py TOOL JSON_ARGUMENTS", file=sys.stderr)
        return 2
    try:
        arguments = json.loads(sys.argv[2])
    except json.JSONDecodeError as exc:
        print(f"JSON_ARGUMENTS: not JSON ({exc})", file=sys.stderr)
        return 2
    url = os.environ.get("MCP_URL", "http://127.0.0.1:8765/mcp")
    token = os.environ.get("MCP_TOKEN", "")
    if not token:
        print("MCP_TOKEN: set it to your token of SIDECAR_MCP_TOKEN_FILE",
              file=sys.stderr)
        return 2
    return asyncio.run(call(url, token, sys.argv[1], arguments))


if __name__ == "__main__":
    sys.exit(main())
