"""paged.py: a paged cache's blocks to and from the pool (CPU here; CUDA with `pytest -m gpu`,
the store's device path: see test_device_io.py for its copy counts)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

from tsukimi.config import MasterConfig
from tsukimi.errors import InvalidArgument
from tsukimi.store.client import StoreClient
from tsukimi.store.master.server import MasterServer
from tsukimi.store.paged import get_blocks, put_blocks

pytestmark = pytest.mark.timeout(60)
_ids = itertools.count()


@pytest.fixture(scope="module")
def client() -> Iterator[StoreClient]:
    master = MasterServer(MasterConfig(rpc_port=0, http_port=0))
    store = StoreClient.connect(master.endpoint, segment_bytes=64 << 20)
    yield store
    store.close()
    master.close()


def _round_trip(client: StoreClient, device: str) -> None:
    cache = torch.randint(0, 255, (64, 2, 16, 4, 32), dtype=torch.uint8, device=device)
    blocks = [5, 0, 63, 17, 18]
    keys = [f"paged-{next(_ids)}" for _ in blocks]
    assert put_blocks(client, keys, cache, blocks) == [None] * 5
    other = torch.zeros_like(cache)
    assert get_blocks(client, [*keys[:4], "paged-missing"], other, [1, 2, 3, 4, 9]) == {9}
    assert torch.equal(other[[1, 2, 3, 4]], cache[[5, 0, 63, 17]])
    assert not other[9].any() and not other[0].any()


def test_blocks_round_trip_on_cpu(client: StoreClient) -> None:
    _round_trip(client, "cpu")
    cache = torch.zeros(4, 8)
    with pytest.raises(InvalidArgument):
        get_blocks(client, ["a"], cache, [4])
    with pytest.raises(InvalidArgument):
        put_blocks(client, ["a", "b"], cache, [0])


@pytest.mark.gpu
def test_blocks_round_trip_on_cuda(client: StoreClient) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _round_trip(client, "cuda")
