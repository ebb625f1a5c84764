"""SGLang's own Mooncake HiCache test, `sglang/srt/mem_cache/storage/mooncake_store/
test_mooncake_store.py`, run unchanged as shipped in 0.5.23 (a script: its `__main__` calls the
tests, one takes a config argument pytest cannot give) from its site-packages directory, under
`tsukimi compat exec`, against the session's `tsukimi compat mooncake-master`.

It covers set/exists/get and batch_set_v1/batch_exists/batch_get_v1 (13 pages) through a mock
page_first host pool at (MHA tp 0/1), (MLA tp 0/1), (MHA tp 1/4), (MLA tp 3/8).
"""

from __future__ import annotations

import pytest

from tests.integrations.sglang.conftest import SGLANG_PYTHON, SITE_PACKAGES, Master, needs_sglang, run_in_sglang

pytestmark = [needs_sglang, pytest.mark.timeout(700)]
SCRIPT_DIR = SITE_PACKAGES / "sglang" / "srt" / "mem_cache" / "storage" / "mooncake_store"


def test_sglangs_mooncake_store_test_passes_unchanged(master: Master) -> None:
    script = SCRIPT_DIR / "test_mooncake_store.py"
    assert script.exists(), f"{script} is not in the SGLang venv"
    run = run_in_sglang([str(SGLANG_PYTHON), script.name], master.env(), cwd=SCRIPT_DIR)
    assert run.returncode == 0, run.output[-6000:]
    assert run.output.count("✅ Batch operation passed") == 4, run.output[-6000:]
    assert "✅ Single operation passed" in run.output and "✅ All tests passed" in run.output
    assert "❌" not in run.output
    # its five stores ran on tsukimi's transfer engine (tsukimi/transfer/engine.py logs this; the
    # real wheel, also in the venv, does not)
    assert run.output.count(" serving on 127.0.0.1:") == 5, run.output[-6000:]
