"""`transfer()` vs `prepare().run()` of one repeated request list, and `transfer()` of a list
never repeated (new remote offsets every call, as a store put's), between two engines in two
processes on this host (docs/benchmarks.md, "Small operations, in progress"):

    .venv/bin/python scripts/transfer_repeat.py            # CELL=64x4 REPS=3 DUR=1 to narrow it

The target is `tsukimi.bench.peer`'s (its shared memory `base`, moved over shm by `auto`, and
its plain process memory `anon_base`, moved over cma); the initiator's buffer is a plain numpy
array, never registered. Prints, per cell and op, the medians of REPS rounds of DUR seconds.
`fresh` moves the same bytes shifted by 64 B x (call number mod FRESH_OFFSETS), more lists
than the plan memo keeps: it shows what the memo costs a caller it never helps.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from tsukimi.bench.transfer import own_code_env
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import OpCode, RequestStatus, TransferEngine, TransferRequest

SIZE = 64 << 20
ALL_CELLS = ((64 << 10, 4), (32 << 10, 256), (4 << 20, 4))
FRESH_OFFSETS = 512  # > plan_memo.MEMO_ENTRIES: no list is seen twice while remembered


def _rate(step: Callable[[], int], seconds: float) -> float:
    for _ in range(3):
        step()
    moved, start = 0, time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        moved += step()
    return moved / (now - start) / 1e9


def main() -> None:
    wanted = os.environ.get("CELL", "")
    cells = [c for c in ALL_CELLS if wanted in ("", f"{c[0] >> 10}x{c[1]}")]
    reps, seconds = int(os.environ.get("REPS", "3")), float(os.environ.get("DUR", "0.25"))
    args = [sys.executable, "-m", "tsukimi.bench.child", "transfer-peer", "target", str(SIZE), "p2p"]
    env = {**os.environ, **own_code_env()}  # NOTE: the target runs this checkout's code, whatever the cwd
    target = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert target.stdout is not None
        ready = json.loads(target.stdout.readline())
        local = np.full(SIZE, 3, np.uint8)
        with TransferEngine(None, Config(transfer=TransferConfig(), metadata=MetadataConfig(url="p2p"))) as engine:
            handle = engine.open_segment(ready["name"])
            calls = itertools.count()
            for where in ("base", "anon_base"):
                for block, batch in cells:
                    for op in (OpCode.WRITE, OpCode.READ):
                        requests = [
                            TransferRequest(op, handle, ready[where] + i * block, local[i * block : (i + 1) * block])
                            for i in range(batch)
                        ]
                        prepared = engine.prepare(requests)

                        def plain(requests: list[TransferRequest] = requests, nbytes: int = block * batch) -> int:
                            assert all(s.state.value == "completed" for s in engine.transfer(requests))
                            return nbytes

                        def fast(
                            run: Callable[[], list[RequestStatus]] = prepared.run, nbytes: int = block * batch
                        ) -> int:
                            run()
                            return nbytes

                        def fresh(op: OpCode = op, block: int = block, batch: int = batch, at: str = where) -> int:
                            shift = 64 * (next(calls) % FRESH_OFFSETS)
                            requests = [
                                TransferRequest(
                                    op, handle, ready[at] + shift + i * block, local[i * block : (i + 1) * block]
                                )
                                for i in range(batch)
                            ]
                            assert all(s.state.value == "completed" for s in engine.transfer(requests))
                            return block * batch

                        got = [
                            (_rate(plain, seconds), _rate(fast, seconds), _rate(fresh, seconds)) for _ in range(reps)
                        ]
                        t, p, f = (statistics.median(g[k] for g in got) for k in range(3))
                        name = f"{'shm ' if where == 'base' else 'anon'} {block >> 10:>5} KiB x {batch:<3} {op.value:5}"
                        print(
                            f"{name} transfer {t:6.2f} GB/s  prepared {p:6.2f} GB/s  ratio {t / p:.2f}",
                            f" fresh {f:6.2f} GB/s",
                            sep="",
                            flush=True,
                        )
    finally:
        if target.stdin is not None:
            target.stdin.close()
        target.wait(10)


if __name__ == "__main__":
    main()
