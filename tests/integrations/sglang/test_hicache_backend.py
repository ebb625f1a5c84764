"""tsukimi's HiCache backend (tsukimi/integrations/sglang/hicache.py) loaded the way SGLang
loads it: `StorageBackendFactory.create_backend("dynamic", ...)` in `.venv-sglang`, against a
tsukimi master in this process. One driver process (tsukimi_hicache_driver.py) runs every scenario
and prints its checks; the tests here read them: the v1 round trip at TP 1, TP 4 and MLA
byte-exact, misses, the legacy and v2 calls, and clear.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tsukimi.config import MasterConfig
from tsukimi.errors import ConfigError
from tsukimi.integrations.sglang.paths import check_venv, sglang_venv
from tsukimi.store.master.server import MasterServer

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("tsukimi_hicache_driver.py")
PAGES = 8


def _python() -> Path:
    try:
        return check_venv(sglang_venv() if os.environ.get("TSUKIMI_SGLANG_VENV") else ROOT / ".venv-sglang")
    except ConfigError:
        pytest.skip("no SGLang venv: run make sglang")


@pytest.fixture(scope="module")
def checks() -> Iterator[dict[str, Any]]:
    python = _python()
    with MasterServer(MasterConfig(rpc_port=0, http_port=0)) as server:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(
            [str(python), str(DRIVER), server.endpoint], capture_output=True, text=True, env=env, timeout=300
        )
    if done.returncode != 0:
        raise AssertionError(f"driver failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    yield json.loads(done.stdout.strip().splitlines()[-1])


ROUND_TRIP = {"set": True, "set_again": True, "exists": PAGES, "get": True, "equal": True}


@pytest.mark.parametrize("tp", [1, 4])
def test_mha_pages_round_trip_byte_exact_per_rank(checks: dict[str, Any], tp: int) -> None:
    result = checks[f"tp{tp}"]
    assert result["ranks"] == [ROUND_TRIP] * tp
    assert result["distinct"]  # each rank's own pages came back, not another rank's
    assert result["backup_pages"] == PAGES  # get_stats: the second set found every page stored
    assert result["local"] == [True] * tp  # local_first: each rank's pages sit in its own segment


def test_mla_pages_are_rank_independent(checks: dict[str, Any]) -> None:
    result = checks["mla"]
    assert result["rank0"] == ROUND_TRIP
    assert (result["rank1_exists"], result["rank1_get"], result["rank1_equal"]) == (PAGES, True, True)


def test_misses_and_bad_calls_answer_false_without_raising(checks: dict[str, Any]) -> None:
    misc = checks["misc"]
    assert misc["type"] == "TsukimiHiCacheStorage"
    assert (misc["miss_get"], misc["miss_exists"], misc["bad_indices"]) == ([False, False], 0, [False])
    assert misc["closed"] == [[False, False], 0, False]


def test_legacy_pointer_calls(checks: dict[str, Any]) -> None:
    misc = checks["misc"]
    assert misc["legacy_set"] and misc["legacy_exists"] and misc["legacy_get"] and misc["legacy_equal"]
    assert misc["legacy_batch_set"] and misc["legacy_batch_get"] == 2


def test_generic_path_flat_pages_without_interface_v1(checks: dict[str, Any]) -> None:
    misc = checks["misc"]
    assert (misc["generic_set"], misc["generic_miss"], misc["generic_equal"]) == (True, True, True)


def test_v2_calls_move_kv_and_side_pools_and_clear_empties(checks: dict[str, Any]) -> None:
    misc = checks["misc"]
    assert misc["v2_set"] == {"kv": True, "swa": True} == misc["v2_get"]
    assert (misc["v2_exists"], misc["v2_equal"]) == (PAGES, True)
    assert (misc["clear"], misc["after_clear"]) == (True, 0)


def test_key_scheme_tells_ranks_apart_as_mooncake_store_does() -> None:
    # NOTE: keys.py imports no sglang: this runs in tsukimi's own venv
    from tsukimi.integrations.sglang.keys import PageKeys, RankLayout

    keys = PageKeys.build("org/m", RankLayout(tp_rank=1, tp_size=2))
    assert keys.page_objects(["h"]) == ["sglang/org-m/h/1"]
    assert PageKeys.build("m", RankLayout(tp_rank=3, is_mla=True)).page_objects(["h"]) == ["sglang/m/h/mla"]
    split = PageKeys.build("m", RankLayout(tp_rank=1, tp_size=2, split_factor=2, pp_size=2, pp_rank=1))
    assert split.page_objects(["h"], "swa") == ["sglang/m/h/2_pp1/swa", "sglang/m/h/3_pp1/swa"]
