"""The paper's experiments run end to end on a small slice of the shipped sample: each gives
its table rows and writes its plots (the full-trace figures are in docs/reproduction.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tsukimi.sim import experiments
from tsukimi.sim.trace import load_trace

SAMPLE = Path(__file__).parents[2] / "data" / "traces" / "conversation_sample.jsonl"


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    return load_trace(SAMPLE, limit=150)


@pytest.mark.parametrize(
    ("function", "rows"),
    [
        (experiments.cache_policies, 2 + len(experiments.CAPACITIES)),
        (experiments.global_vs_local, 2 + 5),
        (experiments.effective_capacity, 2 + len(experiments.TBT_SLOS_S)),
        (experiments.overload, 2 + len(experiments.OVERLOAD_MODES) * len(experiments.OVERLOAD_SHAPES)),
    ],
)
def test_experiment_gives_its_table_and_plots(trace, function, rows: int, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    steps: list[str] = []
    outcome = function(trace, tmp_path, steps.append)
    assert outcome.markdown.count("\n") + 1 == rows and outcome.markdown.startswith("|")
    assert outcome.plots and all(Path(p).stat().st_size > 1000 for p in outcome.plots)
    assert steps  # progress was reported
    assert outcome.data["results"]
