"""The one entry point of the processes benchmarks spawn (benchmarks themselves are `tsukimi
bench ...` subcommands; nothing under bench/ has a `__main__` of its own but this):

    python -m tsukimi.bench.child KIND ARGS...

    KIND             module                     the process
    transfer-peer    bench/peer.py              `bench transfer`'s engines and socket baseline
    nixl-peer        bench/nixl_peer.py         NIXL itself (`bench transfer --compare-nixl`)
    mooncake-te      bench/mooncake_te.py       a real Mooncake TE worker, or its self-test
    store-client     bench/store_peer.py        `bench store`'s measuring client
    mooncake-holder  bench/mooncake_cluster.py  a real Mooncake store holder
    mooncake-store   bench/mooncake_store.py    the real Mooncake store's self-test
    p2p-worker       bench/p2p_worker.py        `bench p2p`'s origin, receivers, gloo ranks
    health-probe     bench/overload_monitor.py  the overload bench's /health prober
    sglang-rank      bench/sglang_rank.py       `bench sglang`'s SGLang ranks (in .venv-sglang)

Each runs under this interpreter (every one imports tsukimi; the vLLM servers that `bench vllm`
and `bench vllm-pd` start under .venv-vllm are `tsukimi up --engine vllm` processes and
tsukimi/testing/vllm_server.py's, not children of this kind). Only the module asked for is
imported, so NIXL, Mooncake and torch stay unloaded where they are not used.
"""

from __future__ import annotations

import importlib
import sys

CHILDREN: dict[str, str] = {
    "transfer-peer": "tsukimi.bench.peer",
    "nixl-peer": "tsukimi.bench.nixl_peer",
    "mooncake-te": "tsukimi.bench.mooncake_te",
    "store-client": "tsukimi.bench.store_peer",
    "mooncake-holder": "tsukimi.bench.mooncake_cluster",
    "mooncake-store": "tsukimi.bench.mooncake_store",
    "p2p-worker": "tsukimi.bench.p2p_worker",
    "health-probe": "tsukimi.bench.overload_monitor",
    "sglang-rank": "tsukimi.bench.sglang_rank",
}


def module_args(kind: str, *args: str) -> list[str]:
    """What follows `python -m` to start a child of `kind` (for `JsonWorker`; pure).

    Raises:
        KeyError: an unknown kind (a bench's own mistake).
    """
    if kind not in CHILDREN:
        raise KeyError(f"unknown bench child {kind!r}; one of {', '.join(CHILDREN)}")
    return [__name__, kind, *args]


def main(argv: list[str]) -> int:
    """Run the child `argv[0]` with the rest of `argv`; its exit status."""
    if not argv or argv[0] not in CHILDREN:
        print(f"usage: python -m {__name__} {{{','.join(CHILDREN)}}} ARGS...", file=sys.stderr)
        return 2
    child_main = importlib.import_module(CHILDREN[argv[0]]).main
    code = child_main(argv[1:])
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
