"""``sidecar receiver``: the reference receiver of fenced side effects (P7, P17, P18).

- ``POST /effects`` (fenced, see sidecar/ops/fence.py): records the JSON body as one row of
  ``fence_effects``, written on the connection the fence hands over, so the effect and
  its bookkeeping commit together. ``201 {"effect_id", "entity", "fence"}``; a body
  that is not JSON is ``400 {"error": "bad_body", ...}``.
- ``GET /effects[?entity=E]``: ``{"effects": [{"id", "idempotency_key", "entity",
  "fence", "body", "received_at"}, ...]}``, oldest first.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import asyncpg
import orjson
from aiohttp import web

from sidecar.ops.fence import FencedRequest, fence_middleware, fenced
from sidecar.protocol import jsontext, parsing
from sidecar.protocol.errors import SidecarError
from sidecar.runtime.config import Settings
from sidecar.storage import db, schema
from sidecar.storage.queries import Q
from sidecar.storage.store import StoreBase

POOL = web.AppKey("pool", asyncpg.Pool)


def _json(value, status: int = 200) -> web.Response:
    return web.Response(body=jsontext.dumps(value), status=status,
                        content_type="application/json")


@fenced
async def post_effect(request: web.Request) -> web.Response:
    fence: FencedRequest = request["fence"]
    try:
        fence.json()
        # A savepoint: if PostgreSQL refuses the JSON (\u0000 in a string), the fence's
        # transaction stays usable and the 400 is recorded like any other answer.
        async with fence.conn.transaction():
            effect_id = await fence.conn.fetchval(
                Q["fence_insert_effect"], fence.idempotency_key, fence.entity, fence.fence,
                fence.body.decode())
    except (orjson.JSONDecodeError, asyncpg.DataError) as exc:
        return _json({"error": "bad_body", "message": f"the body must be one JSON value "
                      f"({str(exc).splitlines()[0]})"}, status=400)
    return _json({"effect_id": effect_id, "entity": fence.entity, "fence": fence.fence},
                 status=201)


async def list_effects(request: web.Request) -> web.Response:
    entity = request.query.get("entity")
    if entity is not None and (not entity.isprintable() or len(entity) > 512):
        return _json({"error": "bad_query", "message": "entity must be 1-512 printable "
                      "characters"}, status=400)
    rows = await request.app[POOL].fetch(Q["fence_list_effects"], entity)
    return _json({"effects": [dict(row) for row in rows]})


# Results forwarded by sidecars may be up to MAX_RESULT_BYTES (8 MiB by default) plus the
# envelope; aiohttp's default request cap (1 MiB) would dead-letter them with a 413.
MAX_BODY_BYTES = 16 * 1024 * 1024


def make_app(pool: asyncpg.Pool) -> web.Application:
    """The receiver's aiohttp application on ``pool`` (migrated); bodies up to 16 MiB."""
    app = web.Application(middlewares=[fence_middleware(pool)],
                          client_max_size=MAX_BODY_BYTES)
    app[POOL] = pool
    app.router.add_post("/effects", post_effect)
    app.router.add_get("/effects", list_effects)
    return app


async def serve(settings: Settings, host: str, port: int) -> int:
    """Check the schema (SchemaMismatch before listening when it is older than this
    sidecar or missing: the receiver never migrates), serve until SIGTERM or SIGINT,
    return 0."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    pool = await db.create_pool(db.resolve_dsn(settings), settings.db_timeout_seconds,
                                max_size=10)
    try:
        await schema.require_current(StoreBase(pool, settings.db_timeout_seconds))
        runner = web.AppRunner(make_app(pool), access_log=None, shutdown_timeout=5)
        await runner.setup()
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as exc:
                raise SidecarError(f"receiver cannot listen on {host}:{port}: "
                                   f"{exc.strerror or exc}") from None
            bound_host, bound_port = runner.addresses[0][:2]
            print("sidecar: receiver listening on "
                  f"http://{parsing.format_host_port(bound_host, bound_port)}",
                  file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await pool.close()
    return 0
