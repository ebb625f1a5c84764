"""SGLang's HiCache Mooncake backend (`MooncakeStore`) unchanged on tsukimi: one run of
hicache_driver.py in the SGLang venv under `tsukimi compat exec` (SGLang's imports are most of
its time), against the session's `tsukimi compat mooncake-master`; each test reads its part of
the driver's JSON.

The host pools are SGLang's own `MHATokenToKVPoolHost` (page_first: K and V objects per page)
and `MLATokenToKVPoolHost` (layer_first: one object per page, one buffer per layer, so the
`*_multi_buffers` calls), built on CPU from SGLang's buffer descriptions.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.conftest import Master, needs_sglang, run_driver

pytestmark = [needs_sglang, pytest.mark.timeout(700)]
PAGES = 6  # hicache_driver.PAGES


@pytest.fixture(scope="module")
def result(master: Master, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hicache") / "result.json"
    return run_driver("hicache_driver.py", {"master_http": master.http}, master.env(), out)


def _assert_round_trip(run: dict[str, Any], pages: int = PAGES) -> None:
    """Every page set, counted, read back byte-exact; a gap after page 2 stops batch_exists."""
    assert run["set"] == [True] * pages and run["get"] == [True] * pages
    assert run["exists"] == pages and run["exists_with_gap_at_2"] == min(2, pages)
    assert run["bytes_equal"] and run["rest_zero"] and run["bytes_compared"] > 0


def test_sglangs_mooncake_store_runs_on_the_facade(result: dict[str, Any]) -> None:
    assert result["store_module"] == "tsukimi.compat.mooncake.store"  # not the real wheel, also installed


@pytest.mark.parametrize("group", ["mha_tp1", "mla_tp1", "mha_tp4", "mha_tp8", "mla_tp8"])
def test_v1_round_trips_byte_exact_with_sglangs_key_layout(result: dict[str, Any], group: str) -> None:
    """batch_set_v1 / batch_exists / batch_get_v1 at each TP size (one MooncakeStore per rank);
    the master holds exactly SGLang's keys: MHA `{key}_{rank}_k|v`, MLA `{key}__k` (shared)."""
    run = result["v1"][group]
    assert len(run["ranks"]) == int(group.removeprefix("mha_tp").removeprefix("mla_tp"))
    for rank in run["ranks"]:
        _assert_round_trip(rank)
    assert run["keys_held"] == run["keys_expected"]


def test_mla_layer_first_pages_are_one_object_of_one_buffer_per_layer(result: dict[str, Any]) -> None:
    mla, mha = result["v1"]["mla_tp1"], result["v1"]["mha_tp1"]
    assert len(mla["keys_held"]) == PAGES and len(mha["keys_held"]) == 2 * PAGES
    assert result["v2"]["mla"]["buffers_per_page"] == 3  # hicache_driver.LAYERS
    assert result["v2"]["mha"]["buffers_per_page"] == 2  # K, V


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v2_pool_transfers_on_a_registered_pool(result: dict[str, Any], kind: str) -> None:
    """batch_set_v2 (with a session id) / batch_exists_v2 / batch_get_v2 on a DRAFT pool
    registered with register_mem_host_pool_v2: SGLang's draft keys, bytes back exactly."""
    run = result["v2"][kind]
    assert run["kv_set"] == [True] * PAGES
    assert run["set"] == {"draft": [True] * PAGES} and run["get"] == {"draft": [True] * PAGES}
    assert run["exists"] == {
        "kv_hit_pages": PAGES,
        "extra_pool_hit_pages": {"kv": PAGES, "draft": PAGES},
        "restorable_prefix_pages": list(range(1, PAGES + 1)),
    }
    assert run["exists_missing_at_3"] == 3
    assert set(run["draft_keys_expected"]) <= set(run["keys_held"])
    assert run["bytes_equal"] and run["rest_zero"] and run["bytes_compared"] > 0


def test_group_semantics_puts_succeed(result: dict[str, Any]) -> None:
    """`enable_group_semantics`: SGLang sees ReplicateConfig.group_ids and puts with one group
    per page (issue 25 B: advertised and implemented)."""
    run = result["groups"]
    assert run["use_group_semantics"] is True
    _assert_round_trip(run)


def test_the_store_starts_on_sglangs_shared_transfer_engine(result: dict[str, Any]) -> None:
    """Issue 25 A and D: with SGLANG_HICACHE_MOONCAKE_REUSE_TE and protocol rdma (tcp here, with
    one warning: no NIXL), MooncakeStore reuses `init_mooncake_transfer_engine`'s engine (its
    segment is named by the engine's session id) after MOONCAKE_CHECK_SERVER found segments."""
    run = result["shared_engine"]
    assert run["segments_before"], "MOONCAKE_CHECK_SERVER needs a segment to be mounted"
    assert run["store_hostname"] == run["session_id"]
    assert run["session_id"] in run["segments_after"] and run["session_id"] not in run["segments_before"]
    assert run["engine_type"] == "tsukimi.transfer.engine.TransferEngine"
    _assert_round_trip(run, pages=1)
    assert result["log_counts"] == {
        "protocol rdma: NIXL is not installed": 1,
        "Reuse initialized mooncake transfer engine": 1,
    }
    assert result["output"].count("NIXL is not installed") == 1
