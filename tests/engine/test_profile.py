"""`tsukimi profile` on the tiny model: it times points and fits a non-negative linear model."""

from __future__ import annotations

import json

import pytest
import torch

from tsukimi.cli import main
from tsukimi.engine.kv_cache import KVLayout
from tsukimi.engine.profile import profile
from tsukimi.engine.weights import random_tiny


def test_profile_fits_the_measured_points() -> None:
    torch.set_num_threads(1)
    tiny = random_tiny(0)
    cfg = tiny.config
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16)
    result = profile(tiny.model, layout, ((8, 0), (32, 0), (32, 64)), ((1, 32), (2, 64), (4, 32)), repeats=1)
    assert len(result.prefill) == 3 and all(s.seconds > 0 for s in result.prefill)
    assert min(result.model.prefill_coef) >= 0 and min(result.model.decode_coef) >= 0
    assert result.model.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def test_profile_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", "tiny", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["prefill_coef"]) == 3 and out["model"]
