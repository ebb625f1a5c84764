"""The store with a cluster secret: clients and holders that know it work; a client without it,
or with another, gets AuthError and changes nothing; the master's state endpoints need signed
requests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tsukimi import auth
from tsukimi.config import ClientConfig, Config, MasterConfig, SecurityConfig
from tsukimi.errors import AuthError
from tsukimi.netio import free_port
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer

SECRET = b"0123456789abcdef-cluster-secret"


def config(tmp_path: Path, master: str, secret: bytes | None, segment_bytes: int = 0) -> Config:
    security = SecurityConfig()
    if secret is not None:
        path = tmp_path / f"secret-{len(secret)}"
        path.write_bytes(secret)
        security = SecurityConfig(secret_file=str(path))
    client = ClientConfig(master=master, segment_bytes=segment_bytes, rpc_timeout_s=2.0)
    return replace(Config(), client=client, security=security)


def test_only_clients_with_the_secret_get_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)
    master = MasterServer(MasterConfig(rpc_port=0, http_port=free_port()), secret=SECRET)
    try:
        with StoreClient(config(tmp_path, master.endpoint, SECRET, 4 << 20)) as holder:
            with StoreClient(config(tmp_path, master.endpoint, SECRET)) as client:
                client.put("k", b"v" * 100)
                assert client.get("k") == b"v" * 100
            for secret in (None, b"another-secret-of-enough-bytes"):
                with pytest.raises(AuthError):
                    StoreClient(config(tmp_path, master.endpoint, secret))
            assert len(master.state.registry.clients) == 2 and list(master.state.objects) == ["k"]
            url = master.http.base_url
            assert httpx.get(url + "/segments", timeout=5).status_code == 401
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # liveness stays open
            headers = auth.sign_headers(SECRET, "GET", "/segments", b"")
            segments = httpx.get(url + "/segments", headers=headers, timeout=5).json()
            assert [s["te_segment"] for s in segments] == [holder.engine.name]
            assert httpx.get(url + "/segments", headers=headers, timeout=5).status_code == 401  # replayed
    finally:
        master.close()
