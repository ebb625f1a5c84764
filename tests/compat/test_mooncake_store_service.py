"""`mooncake.mooncake_store_service` on tsukimi (tsukimi/compat/mooncake/mooncake_store_service.py):
every route over HTTP against a tsukimi master, bad inputs answered 4xx with a message, and
`main` as Mooncake's `mc_store_rest_server` runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tsukimi.compat.mooncake import mooncake_store_service as service
from tsukimi.compat.mooncake.mooncake_store_service import MooncakeStoreService, main
from tsukimi.netio import free_port
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


@pytest.fixture(scope="module")
def master(module_master: MasterServer) -> MasterServer:
    return module_master


@pytest.fixture(scope="module")
def api(master: MasterServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """The service on its own event loop in a thread, and an HTTP client of it."""
    config = tmp_path_factory.mktemp("service") / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": 16 * MIB,
                "local_buffer_size": 4 * MIB,
                "master_server_address": "unused:1",
            }
        )
    )
    # NOTE: -D overrides, as the CLI's: the master comes from cli_config
    service = MooncakeStoreService(str(config), {"master_server_address": master.endpoint.removeprefix("tcp://")})
    started, stop = threading.Event(), threading.Event()
    loop = asyncio.new_event_loop()

    async def run() -> None:
        assert await service.start_store_service(max_wait_time=10)
        assert await service.start_http_service(0)
        started.set()
        await asyncio.to_thread(stop.wait)
        await service.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30)
    with httpx.Client(base_url=f"http://127.0.0.1:{service.port}", timeout=10) as client:
        yield client
    stop.set()
    thread.join(30)
    loop.close()


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert isinstance(message, str) and message
    return message


def test_objects_put_get_exist_remove(api: httpx.Client) -> None:
    assert api.put("/api/put", json={"key": "k", "value": "héllo"}).json() == {"status": "success"}
    got = api.get("/api/get/k")
    assert got.status_code == 200 and got.content == "héllo".encode()
    assert got.headers["content-type"] == "application/octet-stream"
    assert api.get("/api/exist/k").json() == {"exists": True}
    error_of(api.delete("/api/remove/k"), 409)  # the get's read lease holds it a moment
    wait_until(lambda: api.delete("/api/remove/k").status_code == 200, timeout_s=10)
    assert api.get("/api/exist/k").json() == {"exists": False}
    error_of(api.get("/api/get/k"), 404)
    error_of(api.delete("/api/remove/k"), 404)
    error_of(api.put("/api/put", content=b"{not json"), 400)
    error_of(api.put("/api/put", json=["k", "v"]), 400)
    error_of(api.put("/api/put", json={"key": "k"}), 400)
    error_of(api.put("/api/put", json={"key": "", "value": "v"}), 400)
    for i in range(3):
        api.put("/api/put", json={"key": f"all{i}", "value": "v"})
    assert api.delete("/api/remove_all").json() == {"status": "success removed 3 keys"}


def test_a_body_over_the_limit_is_413_declared_or_streamed(api: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "MAX_BODY_BYTES", 1024)
    body = b'{"key": "big", "value": "' + b"v" * 2048 + b'"}'
    error_of(api.put("/api/put", content=body), 413)
    error_of(api.put("/api/put", content=iter([body[:1000], body[1000:]])), 413)  # chunked: no length
    assert api.get("/api/exist/big").json() == {"exists": False}


def test_mount_and_unmount_allocated_segments(api: httpx.Client) -> None:
    mounted = api.post("/api/mount", json={"size": 100}).json()
    assert mounted["status"] == "success" and mounted["allocated_size"] == 16 * MIB
    assert len(mounted["segment_ids"]) == 1
    for bad in ({"size": 0}, {"size": "1MB"}, {}, {"size": MIB, "protocol": 7}):
        error_of(api.post("/api/mount", json=bad), 400)
    error_of(api.post("/api/unmount", json={}), 400)
    error_of(api.post("/api/unmount", json={"segment_ids": ["nope"]}), 400)
    error_of(api.post("/api/unmount", json={"segment_ids": mounted["segment_ids"], "grace_period_seconds": -1}), 400)
    assert api.post("/api/unmount", json={"segment_ids": mounted["segment_ids"][0]}).json() == {"status": "success"}
    error_of(api.post("/api/unmount", json={"segment_ids": mounted["segment_ids"]}), 400)  # gone already


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tsukimi-test-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    with path.open("wb") as f:
        f.truncate(32 * MIB)
    yield name
    path.unlink()


def test_mount_shm_and_unmount_shm(api: httpx.Client, shm_name: str) -> None:
    mounted = api.post("/api/mount_shm", json={"name": f"/{shm_name}", "size": 8 * MIB, "offset": 8 * MIB}).json()
    assert mounted["status"] == "success" and len(mounted["segment_ids"]) == 1
    for bad in ({"name": "../etc", "size": MIB}, {"name": shm_name}, {"size": MIB}, {"name": shm_name, "size": -1}):
        error_of(api.post("/api/mount_shm", json=bad), 400)
    error_of(api.post("/api/mount_shm", json={"name": shm_name, "size": 64 * MIB}), 400)  # past the file's end
    error_of(api.post("/api/mount_shm", json={"name": "tsukimi-no-such-file", "size": MIB}), 400)
    reply = api.post("/api/unmount_shm", json={"segment_ids": ["nope", *mounted["segment_ids"]]})
    error_of(reply, 400)
    assert reply.json()["failed_segment_ids"] == ["nope"]  # the good one went
    error_of(api.post("/api/unmount_shm", json={"segment_ids": []}), 400)


def test_reconfigure_decode_mounts_before_it_breaks_and_prefill_unmounts(api: httpx.Client, shm_name: str) -> None:
    path = f"/dev/shm/{shm_name}"
    first = api.post("/api/reconfigure", json={"mode": "decode", "path": path, "size": 8 * MIB}).json()
    assert first["mode"] == "decode" and len(first["segment_ids"]) == 1
    second = api.post("/api/reconfigure", json={"mode": "DECODE", "path": path, "size": 8 * MIB, "offset": 8 * MIB})
    ids = second.json()["segment_ids"]
    assert len(ids) == 1 and ids != first["segment_ids"]
    failed = api.post("/api/reconfigure", json={"mode": "decode", "path": path, "size": 64 * MIB})
    error_of(failed, 400)
    assert failed.json()["mode"] == "decode"  # the previous segment keeps serving
    error_of(api.post("/api/reconfigure", json={"mode": "decode", "size": MIB}), 400)
    for elsewhere in ("/etc/hostname", "/dev/shm/../etc/hostname", f"/dev/shm/{shm_name}/../../etc/hostname"):
        # NOTE: only shared memory is lent to the pool (the wheel maps any file it is given)
        error_of(api.post("/api/reconfigure", json={"mode": "decode", "path": elsewhere, "size": MIB}), 400)
    error_of(api.post("/api/reconfigure", json={"mode": "both"}), 400)
    error_of(api.post("/api/unmount_shm", json={"segment_ids": first["segment_ids"]}), 400)  # retired already
    assert api.post("/api/reconfigure", json={"mode": "prefill"}).json() == {"status": "success", "mode": "prefill"}
    error_of(api.post("/api/unmount_shm", json={"segment_ids": ids}), 400)


def test_unmount_local_disk(api: httpx.Client) -> None:
    assert api.post("/api/unmount_local_disk", json={}).json() == {"status": "success"}  # no disk: as the wheel
    for bad in ({"grace_period_seconds": -1}, {"grace_period_seconds": 3601}, {"grace_period_seconds": 1.5}):
        error_of(api.post("/api/unmount_local_disk", json=bad), 400)
    error_of(api.post("/api/unmount_local_disk", content=b"[]"), 400)


def test_main_serves_until_sigterm(master: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` as `mc_store_rest_server` runs it (in this process: starting the module under
    `tsukimi compat exec` costs ~15 s of imports here, checked by hand instead)."""
    monkeypatch.setenv("MOONCAKE_MASTER", master.endpoint.removeprefix("tcp://"))
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    port = free_port()
    argv = ["--port", str(port), "--max-wait-time", "20", "-Dlocal_hostname=127.0.0.1", "-Dglobal_segment_size=16MB"]
    argv += ["-Dlocal_buffer_size=4MB", "-Dnot-a-pair"]
    base = f"http://127.0.0.1:{port}"

    def client_side() -> None:
        def up() -> bool:
            try:
                return httpx.get(f"{base}/api/exist/x", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout_s=30)
        assert httpx.put(f"{base}/api/put", json={"key": "cli", "value": "v"}).status_code == 200
        assert httpx.get(f"{base}/api/get/cli").content == b"v"
        os.kill(os.getpid(), signal.SIGTERM)  # NOTE: main's handler is installed: the server is up

    async def both() -> None:
        await asyncio.gather(main(argv), asyncio.to_thread(client_side))

    asyncio.run(both())
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{base}/api/exist/x", timeout=1)
