"""SGLang's PD backend on tsukimi: one run of pd_driver.py in the SGLang venv under `tsukimi
compat exec`, SGLang's `MooncakeTransferEngine` wrapper on the prefill and the decode side,
pages addressed as `MooncakeKVManager` does (`group_concurrent_contiguous`, item_len per layer,
K and V); each test reads its part of the driver's JSON. No master: PD is P2PHANDSHAKE.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.conftest import needs_sglang, run_driver

pytestmark = [needs_sglang, pytest.mark.timeout(700)]
BUFFERS = 6  # pd_driver.LAYERS K buffers and V buffers


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("pd") / "result.json"
    return run_driver("pd_driver.py", {}, {"MOONCAKE_PROTOCOL": "tcp"}, out)


def test_kv_pages_move_byte_exact_as_the_kv_manager_addresses_them(result: dict[str, Any]) -> None:
    assert result["engine_module"] == "tsukimi.compat.mooncake.engine"
    assert result["register"] == [0, 0]
    assert result["blocks"] == 5  # the contiguous runs of the prefill/decode page pairs
    assert result["send"] == [0] * BUFFERS
    assert result["pages_equal"] and result["untouched_zero"]
    assert result["bytes_compared"] == BUFFERS * 7 * 512  # 7 pages of item_len 512 per buffer


def test_probe_of_a_live_and_a_dead_peer(result: dict[str, Any]) -> None:
    assert result["probe_live"] == 0
    assert result["probe_dead"] < 0


def test_a_write_past_the_peers_registered_region_fails(result: dict[str, Any]) -> None:
    assert result["out_of_bounds"] < 0
    assert result["in_bounds"] == 0  # the same write, ending at the region's last byte


def test_writes_fail_after_the_receiver_deregisters(result: dict[str, Any]) -> None:
    assert result["deregister"] == 0
    assert len(result["send_after_deregister"]) == BUFFERS
    assert all(code < 0 for code in result["send_after_deregister"])
