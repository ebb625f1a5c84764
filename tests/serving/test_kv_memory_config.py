"""The KV cache memory setting from `tsukimi up`'s `[workers]` to the `tsukimi worker` flags."""

from __future__ import annotations

import argparse
from pathlib import Path

from tsukimi.config import ClusterConfig, WorkerConfig, load
from tsukimi.serving.worker.commands import add_parser, worker_args, worker_config


def _parse_worker(args: tuple[str, ...]) -> WorkerConfig:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return worker_config(parser.parse_args(list(args)))


def test_workers_table_sets_the_kv_cache_memory_of_every_worker(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text('model = "tiny"\n[workers]\nkv_cache_memory = "1GiB"\n')
    config = load(ClusterConfig, path)
    assert (config.workers.worker.kv_cache_memory, config.workers.worker.num_blocks) == ("1GiB", 0)
    overridden = load(ClusterConfig, path, ['workers.kv_cache_memory="0.25"', "workers.num_blocks=64"])
    assert (overridden.workers.worker.kv_cache_memory, overridden.workers.worker.num_blocks) == ("0.25", 64)


def test_worker_flags_carry_the_kv_cache_memory() -> None:
    config = WorkerConfig(name="d", kv_cache_memory="0.1")
    assert _parse_worker(worker_args(config)) == config
    assert _parse_worker(("worker", "--kv-cache-memory", "2G", "--num-blocks", "7")).num_blocks == 7
