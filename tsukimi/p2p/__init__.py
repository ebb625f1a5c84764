"""The P2P store: master-less payloads produced once and read by many (checkpoints, weights),
fanned out peer to peer over the Transfer Engine (store.py; records.py for what the metadata
service holds; fetch.py for how a reader pulls; weights.py for torch state dicts and files)."""

from tsukimi.p2p.fetch import P2PStats
from tsukimi.p2p.records import PayloadInfo
from tsukimi.p2p.store import P2PStore

__all__ = ["P2PStats", "P2PStore", "PayloadInfo"]
