"""PD direct hand-over without vLLM: a producer's KV buffer (layer-major, like vLLM's CPU
cache) registered with its Transfer Engine, its side channel, and a consumer's PeerReader
READing blocks straight into its own buffer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tsukimi.integrations.vllm.pd import KVLayout, PeerReader, SideChannel
from tsukimi.netio import free_port
from tsukimi.transfer import TransferEngine

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 3, 8, (2, 16, 8)


def _kv_buffer(fill: float) -> list[torch.Tensor]:
    """One allocation cut into per-layer [blocks, *BLOCK_SHAPE] views, as vLLM does on CPU."""
    buffer = torch.full((NUM_LAYERS, NUM_BLOCKS, *BLOCK_SHAPE), fill, dtype=torch.float32)
    return [buffer[layer] for layer in range(NUM_LAYERS)]


@pytest.fixture
def pair() -> Iterator[tuple[list[torch.Tensor], SideChannel, PeerReader, int]]:
    producer_layers = _kv_buffer(0.0)
    for layer, tensor in enumerate(producer_layers):
        for block in range(NUM_BLOCKS):
            tensor[block] = 100 * layer + block
    consumer_layers = _kv_buffer(-1.0)
    with TransferEngine() as producer_engine, TransferEngine() as consumer_engine:
        base = producer_layers[0].untyped_storage()
        producer_engine.register((base.data_ptr(), base.nbytes()))
        block_bytes = producer_layers[0][0].numel() * 4
        layout = KVLayout(producer_engine.name, [t.data_ptr() for t in producer_layers], block_bytes, NUM_BLOCKS, "fmt")
        port = free_port()
        side = SideChannel(layout, "127.0.0.1", port)
        # Generous: the producer's side channel answers within it even on a loaded CI machine
        # (0.5 s was not enough once). Only the unreachable-producer case waits it out, and that
        # test uses its own short-timeout reader.
        reader = PeerReader(consumer_engine, consumer_layers, timeout_s=10.0)
        try:
            yield consumer_layers, side, reader, port
        finally:
            reader.close()
            side.close()


def test_blocks_land_in_the_right_local_blocks_of_every_layer(
    pair: tuple[list[torch.Tensor], SideChannel, PeerReader, int],
) -> None:
    consumer_layers, side, reader, port = pair
    failed = reader.read("127.0.0.1", port, "fmt", remote_ids=[5, 2, 7], local_ids=[0, 1, 6])
    assert failed == set()
    for layer, tensor in enumerate(consumer_layers):
        for remote, local in ((5, 0), (2, 1), (7, 6)):
            assert torch.equal(tensor[local], torch.full(BLOCK_SHAPE, 100.0 * layer + remote))
        assert torch.equal(tensor[3], torch.full(BLOCK_SHAPE, -1.0))  # untouched
    reader.release("127.0.0.1", port, "req-1")
    assert side.take_released() == {"req-1"}
    assert side.take_released() == set()


def test_another_format_or_no_producer_fails_every_block(
    pair: tuple[list[torch.Tensor], SideChannel, PeerReader, int],
) -> None:
    consumer_layers, _, reader, port = pair
    assert reader.read("127.0.0.1", port, "other", [1, 2], [3, 4]) == {3, 4}
    with TransferEngine() as engine:
        impatient = PeerReader(engine, consumer_layers, timeout_s=0.5)
        try:
            assert impatient.read("127.0.0.1", free_port(), "fmt", [1], [5]) == {5}
        finally:
            impatient.close()
    assert torch.equal(consumer_layers[0][3], torch.full(BLOCK_SHAPE, -1.0))


def test_a_block_outside_the_producer_buffer_fails_alone(
    pair: tuple[list[torch.Tensor], SideChannel, PeerReader, int],
) -> None:
    _, _, reader, port = pair
    assert reader.read("127.0.0.1", port, "fmt", [1, NUM_BLOCKS * NUM_LAYERS + 5], [2, 3]) == {3}
