"""The master's Mooncake-style HTTP endpoints: /metrics/summary, /get_all_keys (paged),
/get_all_segments and /batch_query_keys, and the disk tier's Prometheus metrics."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tsukimi.config import ClientConfig, Config
from tsukimi.netio import free_port
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.testing.deployments import MASTER
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(60)
MIB = 1 << 20


def test_summary_keys_pages_and_batch_queries(tmp_path: Path) -> None:
    cfg = replace(MASTER, rpc_port=free_port(), http_port=free_port(), offload="on_put")
    with MasterServer(cfg) as master:
        url = master.http.base_url
        client_cfg = ClientConfig(master=master.endpoint, segment_bytes=4 * MIB, ssd_dir=str(tmp_path), ssd_bytes=MIB)
        assert httpx.get(f"{url}/get_all_segments").text == ""  # nobody mounted yet
        with StoreClient(replace(Config(), client=client_cfg)) as holder:
            for key in ("b", "a", "c"):
                holder.put(key, key.encode() * 1000)
            wait_until(lambda: all(master.state.objects[k].disks for k in "abc"))  # copied at put
            assert httpx.get(f"{url}/get_all_keys").text == "a\nb\nc\n"
            assert httpx.get(f"{url}/get_all_segments").text == f"{holder.engine.name}\n"
            first = httpx.get(f"{url}/get_all_keys", params={"limit": 2})
            assert first.text == "a\nb\n" and first.headers["X-Next-Start-After"] == "b"
            last = httpx.get(f"{url}/get_all_keys", params={"limit": 2, "start_after": "b"})
            assert last.text == "c\n" and "X-Next-Start-After" not in last.headers
            assert httpx.get(f"{url}/get_all_keys", params={"limit": 0}).status_code == 422
            reply = httpx.get(f"{url}/batch_query_keys", params={"keys": "a,zz"}).json()
            a, zz = reply["data"]["a"], reply["data"]["zz"]
            assert (
                reply["success"]
                and a["ok"]
                and zz
                == {
                    "ok": False,
                    "error": "OBJECT_NOT_FOUND",
                    "values": None,
                    "disk_values": None,
                    "local_disk_values": None,
                    "nof_values": None,
                }
            )
            assert [v["size_"] for v in a["values"]] == [1000] and a["values"][0][
                "transport_endpoint_"
            ] == holder.engine.name
            assert holder.disk is not None
            assert [(d["disk_id"], d["size_"]) for d in a["local_disk_values"]] == [(holder.disk.store.disk_id, 1000)]
            assert httpx.get(f"{url}/batch_query_keys").status_code == 400
            summary = httpx.get(f"{url}/metrics/summary").text
            assert (
                summary.startswith("role=leader, state=serving") and "Keys: 3 (soft-pinned: 0, on disk: 3)" in summary
            )
            assert "Offload: 3 (2.93 KB" in summary, summary
            metrics = httpx.get(f"{url}/metrics").text
            assert "tsukimi_master_offloaded_bytes_total 3000.0" in metrics
            assert "tsukimi_master_offload_bytes_per_second" in metrics and "tsukimi_master_disk_used_bytes{" in metrics
