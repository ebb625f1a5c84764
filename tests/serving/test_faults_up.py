"""Faults of a whole `tsukimi up` cluster (real processes, the tiny model, PD with two decode
workers): a worker SIGKILLed mid-stream (its client gets an error event, the next requests go
elsewhere, the supervisor restarts it and it serves again; a restarted prefill worker's KV events
are followed), and a SIGKILLed `tsukimi up` (its children, etcd included, notice through their
lifeline and exit)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.test_cluster import alive, children_of, running, tiny_cluster, up
from tsukimi.testing.processes import wait_until

logger = logging.getLogger(__name__)

BODY = {"model": "tiny", "prompt": "Hello there", "temperature": 0, "ignore_eos": True}


def two_decoders(tmp_path: Path) -> str:
    return tiny_cluster(tmp_path).replace("[workers]\n", "[workers]\ndecode = 2\n")


def complete(api: str, max_tokens: int = 5) -> httpx.Response:
    return httpx.post(api + "/v1/completions", json={**BODY, "max_tokens": max_tokens}, timeout=30)


def workers(api: str) -> dict[str, dict[str, object]]:
    return {w["name"]: w for w in httpx.get(api + "/health", timeout=5).json()["workers"]}


def state_of(tmp_path: Path) -> dict[str, dict[str, object]]:
    return {p["name"]: p for p in json.loads((tmp_path / "state").read_text())["processes"]}


class Stream(threading.Thread):
    """A long streamed completion, read line by line in a thread (`lines`)."""

    def __init__(self, api: str) -> None:
        super().__init__(daemon=True)
        self.api, self.lines, self.status = api, list[str](), 0

    def run(self) -> None:
        body = {**BODY, "max_tokens": 900, "stream": True}
        with httpx.stream("POST", self.api + "/v1/completions", json=body, timeout=60) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)


@pytest.mark.timeout(150)
def test_a_worker_killed_mid_stream_fails_its_stream_cleanly_and_is_restarted(tmp_path: Path) -> None:
    with running(tmp_path, two_decoders(tmp_path)) as state:
        api = str(state["api"])
        expected = complete(api).json()["choices"][0]["text"]
        stream = Stream(api)
        stream.start()

        def decoding() -> list[str]:
            return [n for n, w in workers(api).items() if w["role"] == "decode" and w["in_flight"]]

        wait_until(lambda: len(decoding()) == 1 and len(stream.lines) >= 3, 30, interval_s=0.01)
        [victim] = decoding()
        old_pid = int(state_of(tmp_path)[victim]["pid"])  # type: ignore[call-overload]
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        stream.join(30)
        assert not stream.is_alive() and stream.status == 200
        assert stream.lines[-1] == "data: [DONE]"
        error = json.loads(stream.lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "worker_error" and victim in error["message"]
        assert workers(api)[victim]["healthy"] is False  # marked down by the broken stream
        for _ in range(4):  # the other decode worker serves meanwhile
            response = complete(api)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected

        def restarted() -> bool:
            pid = state_of(tmp_path)[victim]["pid"]
            return pid != old_pid and workers(api)[victim]["healthy"] is True

        wait_until(restarted, 60, interval_s=0.05)
        logger.warning("%s was serving again %.2f s after its SIGKILL", victim, time.monotonic() - killed)
        before = workers(api)[victim]["requests"]
        for _ in range(6):
            response = complete(api)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
        assert workers(api)[victim]["requests"] > before  # type: ignore[operator]
        assert "restarting it in 0.5 s" in (tmp_path / "up.log").read_text()
        restart_and_follow_the_prefill_worker(tmp_path, api)


def restart_and_follow_the_prefill_worker(tmp_path: Path, api: str) -> None:
    """The prefill worker SIGKILLed idle comes back on new KV event ports: the router's prefix
    index follows it there (it expects exactly the reuse the worker then finds)."""
    old_pid = int(state_of(tmp_path)["prefill-0"]["pid"])  # type: ignore[call-overload]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: workers(api)["prefill-0"]["healthy"] is False, 30, interval_s=0.05)
    wait_until(lambda: workers(api)["prefill-0"]["healthy"] is True, 60, interval_s=0.05)
    prompt = list(range(3000, 3040))  # two full blocks and a part, never sent before
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def details() -> tuple[int, int]:
        response = httpx.post(api + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, response.text
        asked = {"request_id": response.headers["x-request-id"]}
        [record] = httpx.get(api + "/decisions", params=asked, timeout=30).json()["decisions"]
        return record["cached_tokens"], record["expected_cached_tokens"]

    assert details() == (0, 0)
    wait_until(lambda: details() == (32, 32), 30, interval_s=0.2)  # the index heard of its blocks


@pytest.mark.timeout(120)
def test_a_sigkilled_up_leaves_no_child_behind(tmp_path: Path) -> None:
    # NOTE: HA masters: etcd (not tsukimi's) runs under the lifeline's wrapper, a grandchild
    supervisor, pids = up(tmp_path, tiny_cluster(tmp_path) + "[master]\nha = 2\n"), dict[str, int]()
    try:
        wait_until(lambda: (tmp_path / "state").exists() or supervisor.poll() is not None, 60)
        assert supervisor.poll() is None, (tmp_path / "up.log").read_text()
        pids |= {name: int(p["pid"]) for name, p in state_of(tmp_path).items()}  # type: ignore[call-overload]
        assert sorted(pids) == ["decode-0", "etcd", "master-0", "master-1", "metadata", "prefill-0", "router"]
        [pids["etcd itself"]] = children_of(pids["etcd"])
        supervisor.kill()
        supervisor.wait(10)
        killed = time.monotonic()
        wait_until(lambda: not any(alive(pid) for pid in pids.values()), 30, interval_s=0.05)
        logger.warning("every child of the SIGKILLed up gone %.2f s after", time.monotonic() - killed)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        for pid in pids.values():
            if alive(pid):  # NOTE: a failed test leaves nothing behind either
                os.killpg(pid, signal.SIGKILL)
