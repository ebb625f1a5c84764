"""`mooncake.mooncake_store_service` on tsukimi: Mooncake's REST store service
(`mc_store_rest_server`), one `MooncakeDistributedStore` behind an HTTP API, served with
FastAPI + uvicorn on 127.0.0.1 by default (the wheel's aiohttp service binds 0.0.0.0).

Routes, as the wheel's (JSON bodies; errors are {"error": message}):

| route                          | does                                                         |
|--------------------------------|--------------------------------------------------------------|
| PUT /api/put                   | {"key", "value": text} stored as its UTF-8 bytes             |
| GET /api/get/{key}             | the bytes (application/octet-stream); 404 on a miss          |
| GET /api/exist/{key}           | {"exists": bool}                                             |
| DELETE /api/remove/{key}       | remove one object                                            |
| DELETE /api/remove_all         | remove every object: {"status": "success removed N keys"}    |
| POST /api/mount                | allocate_and_mount_segment {"size", "protocol", "location"}  |
| POST /api/unmount              | unmount_and_free_segment {"segment_ids", "grace_period_seconds"} |
| POST /api/mount_shm            | mount_segment of /dev/shm/{"name"} {"size", "offset", ...}  |
| POST /api/unmount_shm          | unmount_segment, id by id {"segment_ids", ...}               |
| POST /api/unmount_local_disk   | unmount_local_disk_segment {"grace_period_seconds": 0..3600} |
| POST /api/reconfigure          | {"mode": "decode", "path", "size", ...}: mount, then retire  |
|                                | the last decode mount; {"mode": "prefill"}: unmount it       |

Where the wheel answers a caller's mistake with 500 (malformed JSON, an unknown segment id, a
missing file, a missing key to remove) this service answers 4xx with the message: 400 for a bad
request or a store code that names the caller's argument (-1, -600), 404 for a missing key, 409
for a remove while a reader's lease holds the object. Failures of the store itself stay 500.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tsukimi.compat.mooncake.codes import INVALID_PARAMS, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND
from tsukimi.compat.mooncake.mooncake_config import MooncakeConfig
from tsukimi.compat.mooncake.segments import FAILED
from tsukimi.compat.mooncake.store import MooncakeDistributedStore
from tsukimi.httpd import listen

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
MAX_BODY_BYTES = 100 << 20  # NOTE: the wheel's aiohttp client_max_size
_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS = 3600  # NOTE: the wheel's cap (a preStop hook's wait)
_CALLERS_CODES = (FAILED, INVALID_PARAMS)  # store answers that name the caller's argument
Json = dict[str, object]


class BadRequest(Exception):
    """A request this service refuses: its HTTP status and message."""

    def __init__(self, message: str, status: int = 400, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


def _reply(body: Mapping[str, object], status: int = 200) -> Response:
    return JSONResponse(body, status_code=status)


def _failed(what: str, code: int, **extra: object) -> BadRequest:
    """A store code as an HTTP error: 400 when it names the caller's argument, else 500."""
    return BadRequest(f"{what} failed, ret={code}", 400 if code in _CALLERS_CODES else 500, **extra)


async def _body(request: Request) -> bytes:
    """The request's body, at most MAX_BODY_BYTES (413 past it, before reading it whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def _json(request: Request) -> Json:
    """The body as a JSON object. Raises BadRequest."""
    try:
        data = json.loads(await _body(request))
    except ValueError:
        raise BadRequest("Malformed JSON body") from None
    if not isinstance(data, dict):
        raise BadRequest("Request body must be a JSON object")
    return data


def _count(data: Json, name: str, default: int | None = None, most: int | None = None) -> int:
    """A non-negative int field (at most `most`). Raises BadRequest."""
    value = data.get(name, default)
    if type(value) is not int or value < 0 or (most is not None and value > most):
        bound = "" if most is None else f" no greater than {most}"
        raise BadRequest(f"Invalid {name}, must be a non-negative integer{bound}")
    return value


def _text(data: Json, name: str, default: str) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise BadRequest(f"Invalid {name}, must be a string")
    return value


def _segment_ids(data: Json) -> list[str]:
    """`segment_ids`: a list of strings, or one string. Raises BadRequest."""
    ids = data.get("segment_ids", [])
    ids = [ids] if isinstance(ids, str) else ids
    if not ids or not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise BadRequest("Missing segment_ids")
    return list(ids)


def _shm_path(name: object) -> str:
    """/dev/shm/NAME for a plain shared-memory name (a leading "/" allowed). Raises BadRequest."""
    plain = name[1:] if isinstance(name, str) and name.startswith("/") else name
    if not isinstance(plain, str) or not plain or "/" in plain or plain in (".", ".."):
        raise BadRequest("Missing or invalid name or size")
    return f"/dev/shm/{plain}"


def _decode_path(path: object) -> str:
    """A decode-mode segment file: a file under /dev/shm only. Raises BadRequest.

    NOTE: the wheel maps any path it is given, writable, and lends it to the pool; anyone who
    can reach the port could then have other clients' puts overwrite any file this process may
    write. Shared memory is what the service's mounts are for."""
    if not isinstance(path, str) or not path:
        raise BadRequest("Missing path or size for decode mode")
    real = os.path.realpath(path)
    if os.path.dirname(real) != "/dev/shm":
        raise BadRequest(f"path must name a file in /dev/shm, got {path!r}")
    return real


Handler = Callable[[Request], Awaitable[Response]]


def _route(name: str, handler: Handler) -> Handler:
    """`handler` answering BadRequest with its status, any other error with 500, timed."""

    async def answer(request: Request) -> Response:
        start = time.perf_counter()
        try:
            return await handler(request)
        except BadRequest as exc:
            return _reply({"error": str(exc), **exc.extra}, exc.status)
        except Exception as exc:  # NOTE: the wheel's handlers answer every failure with 500
            logger.exception("%s failed", name)
            return _reply({"error": str(exc)}, 500)
        finally:
            logger.info("%s operation completed in %.2f ms", name, (time.perf_counter() - start) * 1e3)

    return answer


class MooncakeStoreService:
    """Mooncake's store service: a store set up from a `MooncakeConfig` (a JSON file, else the
    environment), with `cli_config` fields overriding it, and its REST API (see the module)."""

    def __init__(self, config_path: str | None = None, cli_config: dict[str, object] | None = None) -> None:
        self.store: MooncakeDistributedStore | None = None
        self.host = DEFAULT_HOST
        self.port = 0  # NOTE: the bound port once start_http_service ran (its `port` may be 0)
        self.current_mode = "prefill"
        self.mounted_segment_ids: list[str] = []
        self.last_mount_info: Json = {}
        self._state_lock = asyncio.Lock()
        self._disk_unmount = asyncio.Lock()
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self.config = MooncakeConfig.from_file(config_path) if config_path else MooncakeConfig.load_from_env()
        for key, value in (cli_config or {}).items():
            if hasattr(self.config, key):
                setattr(self.config, key, value)
        logger.info("Mooncake configuration loaded")

    async def start_store_service(self, max_wait_time: float = 60, shutdown_event: asyncio.Event | None = None) -> bool:
        """Set the store up, retrying every second for `max_wait_time` seconds; True once it is,
        False on timeout or when `shutdown_event` is set."""
        deadline = time.monotonic() + max_wait_time
        attempt = 0
        while shutdown_event is None or not shutdown_event.is_set():
            if time.monotonic() >= deadline:
                logger.error(
                    "Store startup failed: exceeded max wait time of %ss after %d attempts", max_wait_time, attempt
                )
                return False
            attempt += 1
            store = MooncakeDistributedStore()
            if await asyncio.to_thread(store.setup, self._setup_dict()) == 0:
                self.store = store
                logger.info("Store service started successfully on %s", self.config.local_hostname)
                return True
            logger.warning("Store startup failed (attempt %d); retrying", attempt)
            pause = max(0.0, min(1.0, deadline - time.monotonic()))
            if shutdown_event is None:
                await asyncio.sleep(pause)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(shutdown_event.wait(), pause)
        logger.info("Store startup cancelled by shutdown request")
        return False

    def _setup_dict(self) -> Json:
        c = self.config
        return {
            "local_hostname": c.local_hostname,
            "metadata_server": c.metadata_server,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "protocol": c.protocol,
            "rdma_devices": c.device_name or "",
            "master_server_addr": c.master_server_address,
            "enable_ssd_offload": c.enable_ssd_offload,
            "ssd_offload_path": c.ssd_offload_path,
            "tenant_id": c.tenant_id,
        }

    def http_app(self) -> FastAPI:
        """The REST API as a FastAPI app (the routes of the module)."""
        app = FastAPI(title="Mooncake Store Service (tsukimi)")
        for method, path, name, handler in (
            ("POST", "/api/reconfigure", "RECONFIGURE", self.handle_reconfigure),
            ("POST", "/api/mount_shm", "MOUNT_SHM", self.handle_mount_shm),
            ("POST", "/api/unmount_shm", "UNMOUNT_SHM", self.handle_unmount_shm),
            ("POST", "/api/mount", "MOUNT", self.handle_mount),
            ("POST", "/api/unmount", "UNMOUNT", self.handle_unmount),
            ("POST", "/api/unmount_local_disk", "UNMOUNT_LOCAL_DISK", self.handle_unmount_local_disk),
            ("PUT", "/api/put", "PUT", self.handle_put),
            ("GET", "/api/get/{key}", "GET", self.handle_get),
            ("GET", "/api/exist/{key}", "EXIST", self.handle_exist),
            ("DELETE", "/api/remove/{key}", "REMOVE", self.handle_remove),
            ("DELETE", "/api/remove_all", "REMOVE_ALL", self.handle_remove_all),
        ):
            app.add_api_route(path, _route(name, handler), methods=[method])
        return app

    async def start_http_service(self, port: int = 8080) -> bool:
        """Serve the REST API on `self.host`:`port` from this event loop; True once it listens.
        Raises OSError (the address cannot be bound)."""
        sock = listen(self.host, port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.http_app(), log_level="warning", access_log=False, lifespan="off")
        server = self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._serving.done():
                self._serving.result()
                return False
            await asyncio.sleep(0.01)
        logger.info("REST API started on %s:%d", self.host, self.port)
        return True

    def _ready(self) -> MooncakeDistributedStore:
        if self.store is None:
            raise BadRequest("the store is not set up", 503)
        return self.store

    # -- objects -----------------------------------------------------------------------

    async def handle_put(self, request: Request) -> Response:
        """PUT /api/put {"key", "value"}: store the value's UTF-8 bytes under the key."""
        data = await _json(request)
        key, value = data.get("key"), data.get("value")
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise BadRequest("Missing key or value")
        code = await asyncio.to_thread(self._ready().put, key, value.encode())
        if code != 0:
            raise _failed("PUT operation", code)
        return _reply({"status": "success"})

    async def handle_get(self, request: Request) -> Response:
        """GET /api/get/{key}: the object's bytes, 404 on a miss."""
        store, key = self._ready(), request.path_params["key"]
        exists = await asyncio.to_thread(store.is_exist, key)
        if exists < 0:
            raise BadRequest("Exist check failed", 500)
        value = await asyncio.to_thread(store.get, key) if exists else b""
        if not exists or (value == b"" and await asyncio.to_thread(store.is_exist, key) == 0):
            raise BadRequest("Key not found", 404)
        return Response(bytes(value), media_type="application/octet-stream")

    async def handle_exist(self, request: Request) -> Response:
        """GET /api/exist/{key}: {"exists": bool}."""
        exists = await asyncio.to_thread(self._ready().is_exist, request.path_params["key"])
        if exists < 0:
            raise BadRequest("Exist check failed", 500)
        return _reply({"exists": exists > 0})

    async def handle_remove(self, request: Request) -> Response:
        """DELETE /api/remove/{key}: 404 when there is no such object."""
        code = await asyncio.to_thread(self._ready().remove, request.path_params["key"])
        if code == OBJECT_NOT_FOUND:
            raise BadRequest("Key not found", 404)
        if code == OBJECT_HAS_LEASE:
            raise BadRequest("Key is being read (a read lease holds it): retry", 409)
        if code != 0:
            raise _failed("Remove operation", code)
        return _reply({"status": "success"})

    async def handle_remove_all(self, request: Request) -> Response:
        """DELETE /api/remove_all: how many objects went."""
        removed = await asyncio.to_thread(self._ready().remove_all)
        if removed < 0:
            raise BadRequest("RemoveAll operation failed", 500)
        return _reply({"status": f"success removed {removed} keys"})

    # -- segments ----------------------------------------------------------------------

    async def handle_mount(self, request: Request) -> Response:
        """POST /api/mount {"size", "protocol", "location"}: allocate_and_mount_segment."""
        data = await _json(request)
        size = data.get("size")
        if type(size) is not int or size <= 0:
            raise BadRequest("Invalid size, must be a positive integer")
        protocol, location = _text(data, "protocol", self.config.protocol), _text(data, "location", "")
        result = await asyncio.to_thread(self._ready().allocate_and_mount_segment, size, protocol, location)
        code = int(str(result["ret"]))
        if code != 0:
            raise _failed("Allocate and mount", code)
        body = {"status": "success", "segment_ids": result["segment_ids"], "allocated_size": result["allocated_size"]}
        return _reply(body)

    async def handle_unmount(self, request: Request) -> Response:
        """POST /api/unmount {"segment_ids", "grace_period_seconds"}: unmount_and_free_segment."""
        data = await _json(request)
        ids, grace = _segment_ids(data), _count(data, "grace_period_seconds", 0)
        code = await asyncio.to_thread(self._ready().unmount_and_free_segment, ids, grace)
        if code != 0:
            raise _failed("Unmount and free", code)
        return _reply({"status": "success"})

    async def handle_mount_shm(self, request: Request) -> Response:
        """POST /api/mount_shm {"name", "size", "offset", "protocol", "location"}: mount_segment
        of /dev/shm/name."""
        data = await _json(request)
        path = _shm_path(data.get("name"))
        if "size" not in data:
            raise BadRequest("Missing or invalid name or size")
        size, offset = _count(data, "size"), _count(data, "offset", 0)
        protocol, location = _text(data, "protocol", self.config.protocol), _text(data, "location", "")
        result = await asyncio.to_thread(self._ready().mount_segment, path, size, offset, protocol, location)
        code = int(str(result["ret"]))
        if code != 0:
            raise _failed("Mount", code)
        return _reply({"status": "success", "segment_ids": result["segment_ids"]})

    async def handle_unmount_shm(self, request: Request) -> Response:
        """POST /api/unmount_shm {"segment_ids", "grace_period_seconds"}: unmount_segment, id by
        id; those that failed are named."""
        data = await _json(request)
        ids, grace = _segment_ids(data), _count(data, "grace_period_seconds", 0)
        store = self._ready()
        failed: list[str] = []
        status = 400
        async with self._state_lock:
            for segment_id in ids:
                code = await asyncio.to_thread(store.unmount_segment, [segment_id], grace)
                if code != 0:
                    failed.append(segment_id)
                    status = status if code in _CALLERS_CODES else 500
                elif segment_id in self.mounted_segment_ids:
                    self.mounted_segment_ids.remove(segment_id)
            if not self.mounted_segment_ids:
                self.current_mode = "prefill"
        if failed:
            raise BadRequest("Unmount failed for one or more segments", status, failed_segment_ids=failed)
        return _reply({"status": "success"})

    async def handle_unmount_local_disk(self, request: Request) -> Response:
        """POST /api/unmount_local_disk {"grace_period_seconds"}: withdraw the disk tier (a
        preStop hook's call; it holds for the grace period)."""
        data = await _json(request)
        grace = _count(data, "grace_period_seconds", 0, _MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS)
        store = self._ready()
        if self._disk_unmount.locked():  # NOTE: each holds a worker thread for its grace period
            raise BadRequest("an unmount of the local disk is running already", 409)
        async with self._disk_unmount:
            code = await asyncio.to_thread(store.unmount_local_disk_segment, grace)
        if code != 0:
            raise _failed("Unmount local disk", code)
        return _reply({"status": "success"})

    async def handle_reconfigure(self, request: Request) -> Response:
        """POST /api/reconfigure {"mode": "decode", "path", "size", ...}: mount the file range,
        then retire the segments of the last decode mount; {"mode": "prefill"}: unmount them."""
        data = await _json(request)
        mode = _text(data, "mode", "").lower()
        if mode == "decode":
            return await self._decode(data)
        if mode != "prefill":
            raise BadRequest("Invalid mode. Use 'decode' or 'prefill'")
        store = self._ready()
        async with self._state_lock:
            if self.mounted_segment_ids:
                code = await asyncio.to_thread(store.unmount_segment, self.mounted_segment_ids)
                if code != 0:
                    raise _failed("Unmount", code)
                self.mounted_segment_ids.clear()
            self.current_mode = "prefill"
            self.last_mount_info.clear()
        return _reply({"status": "success", "mode": self.current_mode})

    async def _decode(self, data: Json) -> Response:
        if "size" not in data:
            raise BadRequest("Missing path or size for decode mode")
        path = _decode_path(data.get("path"))
        size, offset = _count(data, "size"), _count(data, "offset", 0)
        protocol, location = _text(data, "protocol", self.config.protocol), _text(data, "location", "")
        store = self._ready()
        async with self._state_lock:
            previous = list(self.mounted_segment_ids)
            result = await asyncio.to_thread(store.mount_segment, path, size, offset, protocol, location)
            code = int(str(result["ret"]))
            if code != 0:
                if previous:  # NOTE: make before break: the old segments keep serving
                    raise _failed("Mount", code, mode=self.current_mode)
                self.current_mode = "prefill"
                self.last_mount_info.clear()
                raise _failed("Mount", code, mode=self.current_mode)
            kept = [sid for sid in previous if await asyncio.to_thread(store.unmount_segment, [sid]) != 0]
            if kept:
                logger.warning("reconfigure decode: could not unmount %s; kept for a later unmount", kept)
            new_ids = result["segment_ids"]
            assert isinstance(new_ids, list)
            self.mounted_segment_ids = [*new_ids, *kept]
            self.current_mode = "decode"
            self.last_mount_info = {
                "path": path,
                "offset": offset,
                "size": size,
                "protocol": protocol,
                "location": location,
            }
        return _reply({"status": "success", "mode": self.current_mode, "segment_ids": self.mounted_segment_ids})

    async def stop(self) -> None:
        """Stop serving HTTP and close the store (idempotent)."""
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = self._serving = None
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.to_thread(store.close)
            logger.info("Mooncake service stopped")


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The wheel's flags (--config, -D key=value, --port, --max-wait-time), and --host."""
    parser = argparse.ArgumentParser(
        # NOTE: under `tsukimi compat exec` the aliased module leaves sys.argv[0] None
        prog="python -m mooncake.mooncake_store_service",
        description="Mooncake Store Service with REST API (tsukimi)",
    )
    parser.add_argument("--config", type=str, help="Path to Mooncake config file", required=False)
    parser.add_argument(
        "-D",
        "--define",
        action="append",
        default=[],
        help="Override configuration with key=value pairs (e.g., -Dlocal_hostname=example.com)",
    )
    parser.add_argument("--port", type=int, default=8080, help="HTTP API port (default: 8080)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP API address (default: {DEFAULT_HOST})")
    parser.add_argument("--max-wait-time", type=float, default=60, help="Maximum total wait time in seconds")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> None:
    """Run the service until SIGINT/SIGTERM. Raises RuntimeError (the store or the HTTP API
    did not start)."""
    args = parse_arguments(argv)
    cli_config: dict[str, object] = {}
    for item in args.define:
        key, sep, value = item.partition("=")
        if sep:
            cli_config[key] = value
        else:
            logger.warning("Ignoring invalid CLI config: %s", item)
    service = MooncakeStoreService(args.config, cli_config)
    service.host = args.host
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, shutdown.set)
    try:
        if not await service.start_store_service(args.max_wait_time, shutdown):
            if shutdown.is_set():
                return
            raise RuntimeError("Failed to start store service")
        if not await service.start_http_service(args.port):
            raise RuntimeError("Failed to start HTTP service")
        logger.info("Mooncake Store Service is running on %s:%d", service.host, service.port)
        await shutdown.wait()
    finally:
        await service.stop()


def sync_main() -> None:
    """The `mc_store_rest_server` entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    asyncio.run(main())


if __name__ == "__main__":
    sync_main()
