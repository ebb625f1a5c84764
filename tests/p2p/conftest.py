"""Fixtures of the P2P store tests: a metadata service per backend, and stores on it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.etcd_server import EtcdProcess
from tests.transfer.conftest import etcd_proc, http_server  # noqa: F401 (fixtures shared with the metadata tests)
from tsukimi.config import Config, MetadataConfig, P2PConfig, SecurityConfig, TransferConfig
from tsukimi.p2p import P2PStore
from tsukimi.transfer.metadata.http import ServerHandle

MakeStore = Callable[..., P2PStore]
SECRET = "p2p-tests-cluster-secret-0123456789"


@pytest.fixture(autouse=True)
def _no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TSUKIMI_CLUSTER_SECRET", raising=False)


@pytest.fixture(params=["memory", "http", "etcd"])
def metadata_url(request: pytest.FixtureRequest) -> str:
    """The URL of a metadata service of each backend (memory: private to this test)."""
    if request.param == "memory":
        return f"memory://p2p-{uuid.uuid4().hex}"
    if request.param == "http":
        handle: ServerHandle = request.getfixturevalue("http_server")
        return handle.url
    proc: EtcdProcess = request.getfixturevalue("etcd_proc")
    return proc.url


def store_config(
    url: str,
    *,
    shard_bytes: int = 64 << 10,
    ttl_s: float = 2.0,
    secret_file: str = "",
    transport: str = "auto",
    **p2p: object,
) -> Config:
    """A P2P store's config on `url` (small shards, so small payloads have several)."""
    return Config(
        metadata=MetadataConfig(url=url),
        transfer=TransferConfig(transport=transport),
        security=SecurityConfig(secret_file=secret_file),
        p2p=P2PConfig(max_shard_bytes=shard_bytes, holder_ttl_s=ttl_s, **p2p),  # type: ignore[arg-type]
    )


@pytest.fixture
def make_store(metadata_url: str) -> Iterator[MakeStore]:
    """Opens P2P stores on this test's metadata service; closes them all afterwards."""
    stores: list[P2PStore] = []

    def make(**settings: object) -> P2PStore:
        store = P2PStore(store_config(metadata_url, **settings))  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make
    for store in reversed(stores):
        store.close()


@pytest.fixture
def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return str(path)
