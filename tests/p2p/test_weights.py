"""Torch state dicts and files through the P2P store."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.p2p.conftest import store_config
from tsukimi.errors import InvalidArgument, PayloadNotFound
from tsukimi.p2p import P2PStore
from tsukimi.p2p.weights import fetch_to_file, publish_file, publish_state_dict, receive_state_dict

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def stores() -> Iterator[tuple[P2PStore, P2PStore]]:
    url = f"memory://weights-{uuid.uuid4().hex}"
    with P2PStore(store_config(url)) as origin, P2PStore(store_config(url)) as reader:
        yield origin, reader


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """A small state dict with what real ones have: tied tensors, bf16, an empty tensor."""
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(300, 64, generator=generator)
    return {
        "embed.weight": embed,
        "layers.0.attn.qkv": torch.randn(64, 192, generator=generator).to(torch.bfloat16),
        "layers.0.norm": torch.randn(64, generator=generator),
        "lm_head.weight": embed,  # tied
        "empty": torch.empty(0),
    }


def fresh_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: torch.zeros_like(t) for name, t in state.items()}
    out["lm_head.weight"] = out["embed.weight"]
    return out


def test_a_state_dict_arrives_in_place_in_the_receivers_tensors(stores: tuple[P2PStore, P2PStore]) -> None:
    origin, reader = stores
    state = model_state(1)
    info = publish_state_dict(origin, "w1", state)
    assert info.total_bytes == 300 * 64 * 4 + 64 * 192 * 2 + 64 * 4  # the tied tensor once
    into = fresh_like(state)
    pointers = {name: t.data_ptr() for name, t in into.items()}
    receive_state_dict(reader, "w1", into)
    for name, tensor in state.items():
        assert torch.equal(into[name], tensor), name
        assert into[name].data_ptr() == pointers[name]


def test_untied_receivers_get_the_alias_copied(stores: tuple[P2PStore, P2PStore]) -> None:
    origin, reader = stores
    state = model_state(2)
    publish_state_dict(origin, "w2", state)
    into = {name: torch.zeros_like(t) for name, t in state.items()}  # lm_head its own tensor
    receive_state_dict(reader, "w2", into)
    assert torch.equal(into["lm_head.weight"], state["embed.weight"])


def test_a_mismatched_receiver_is_refused_before_any_byte_lands(stores: tuple[P2PStore, P2PStore]) -> None:
    origin, reader = stores
    state = model_state(3)
    publish_state_dict(origin, "w3", state)
    wrong_shape = fresh_like(state)
    wrong_shape["layers.0.norm"] = torch.zeros(65)
    with pytest.raises(InvalidArgument, match=r"layers\.0\.norm"):
        receive_state_dict(reader, "w3", wrong_shape)
    wrong_dtype = fresh_like(state)
    wrong_dtype["layers.0.attn.qkv"] = torch.zeros(64, 192)
    with pytest.raises(InvalidArgument, match="bfloat16"):
        receive_state_dict(reader, "w3", wrong_dtype)
    missing = fresh_like(state)
    del missing["empty"]
    with pytest.raises(InvalidArgument, match="missing"):
        receive_state_dict(reader, "w3", missing)
    assert all(not t.any() for t in wrong_shape.values())
    assert reader.open_payloads() == {}
    with pytest.raises(PayloadNotFound):
        receive_state_dict(reader, "nope", fresh_like(state))


def test_a_payload_that_is_not_a_state_dict_is_refused(stores: tuple[P2PStore, P2PStore]) -> None:
    origin, reader = stores
    origin.register("raw", [bytearray(100)])
    with pytest.raises(InvalidArgument, match="not a published state dict"):
        receive_state_dict(reader, "raw", {"x": torch.zeros(25)})


def test_a_file_round_trips_without_being_written(stores: tuple[P2PStore, P2PStore], tmp_path: Path) -> None:
    origin, reader = stores
    source = tmp_path / "model.safetensors"
    payload = os.urandom(300_000)
    source.write_bytes(payload)
    before = source.stat().st_mtime_ns
    info = publish_file(origin, "file", source, max_shard_bytes=65536)
    assert len(info.shard_sizes) == 5
    out = tmp_path / "copy.bin"
    fetch_to_file(reader, "file", out)
    assert out.read_bytes() == payload
    assert source.stat().st_mtime_ns == before
    assert reader.open_payloads() == {}  # withdrawn once written
    with pytest.raises(InvalidArgument, match="empty"):
        (tmp_path / "empty").write_bytes(b"")
        publish_file(origin, "empty", tmp_path / "empty")
    with pytest.raises(InvalidArgument, match="cannot map"):
        publish_file(origin, "missing", tmp_path / "missing")
