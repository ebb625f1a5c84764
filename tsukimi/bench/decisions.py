"""The router's decision records as a bench reads them: `GET /decisions?request_id=ID...` by the
request ids the bench sent (`X-Request-Id`), never by re-hashing prompts.

The records are the router's (tsukimi/serving/router/decision_log.py, the contract of issue 22):
what the Conductor predicted at arrival (`predicted_ttft_s`, `queued`), what the prefix index
expected the prefill worker to reuse (`expected_cached_tokens`, `expected_concurrent`) and
what it really reused (`cached_tokens`), decoded into the router's own `DecisionRecord`; a
router without the endpoint (404: an older router) gives no records at all.

`index_accuracy` is `tsukimi bench serve`'s reading of them: `index_exact_ratio` (the share of
requests whose reuse the index expected exactly), `index_up_to_date_ratio` (counting only the
misses that were not "concurrent") and the misses by direction and cause:
"over" (the index held blocks the worker no longer had) or "under" (the worker had blocks the
index had not heard of), "concurrent" (other prefills ran on that worker at placement: they
stored or evicted blocks before this one was admitted, which no index can know yet) or "behind"
(none did: the worker's cache stood still and the index had missed or not yet applied an event).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import urlencode

import httpx
import msgspec

from tsukimi.errors import ProtocolError
from tsukimi.serving.router.decision_log import DecisionRecord

_IDS_PER_CALL = 64  # NOTE: keeps each URL short (ids are a few dozen characters)


class _Decisions(msgspec.Struct, frozen=True):
    decisions: list[DecisionRecord]


def parse_decisions(body: bytes | str) -> list[DecisionRecord]:
    """The records of a `GET /decisions` answer (pure).

    Raises:
        ProtocolError: not `{"decisions": [RECORD, ...]}`.
    """
    try:
        return msgspec.json.decode(body, type=_Decisions).decisions
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not an answer of GET /decisions: {exc}") from exc


def fetch_decisions(api: str, request_ids: Iterable[str], timeout_s: float = 30.0) -> dict[str, DecisionRecord]:
    """The router's records of `request_ids` (those it still holds), by request id; {} when the
    router has no /decisions endpoint (404).

    Raises:
        ProtocolError: the router answered another error, or not at all (the httpx error
            chained), or a malformed answer.
    """
    ids = list(dict.fromkeys(request_ids))
    found: dict[str, DecisionRecord] = {}
    with httpx.Client(timeout=timeout_s) as client:
        for at in range(0, len(ids), _IDS_PER_CALL):
            query = urlencode([("request_id", rid) for rid in ids[at : at + _IDS_PER_CALL]])
            try:
                response = client.get(f"{api}/decisions?{query}")
            except httpx.HTTPError as exc:
                raise ProtocolError(f"GET {api}/decisions failed: {exc}") from exc
            if response.status_code == 404:
                return {}
            if response.status_code != 200:
                raise ProtocolError(f"GET {api}/decisions answered {response.status_code}: {response.text[:200]}")
            found.update((r.request_id, r) for r in parse_decisions(response.content))
    return found


def index_accuracy(records: Sequence[DecisionRecord]) -> dict[str, object]:
    """index_exact_ratio and index_up_to_date_ratio over the records with an expectation and a
    measured reuse (None without any: colocated, or no records), and the misses by direction
    and cause (see the module). Pure."""
    known = [r for r in records if r.expected_cached_tokens is not None and r.cached_tokens is not None]
    misses = {f"{d}_{c}": 0 for d in ("over", "under") for c in ("concurrent", "behind")}
    for r in known:
        expected, cached = r.expected_cached_tokens or 0, r.cached_tokens or 0
        if expected != cached:
            direction = "over" if expected > cached else "under"
            misses[f"{direction}_{'concurrent' if r.expected_concurrent else 'behind'}"] += 1
    if not known:
        return {"index_exact_ratio": None, "index_up_to_date_ratio": None, "index_mismatches": misses}
    behind = misses["over_behind"] + misses["under_behind"]
    return {
        "index_exact_ratio": round(1 - sum(misses.values()) / len(known), 4),
        "index_up_to_date_ratio": round(1 - behind / len(known), 4),
        "index_mismatches": misses,
    }
