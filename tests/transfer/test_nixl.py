"""The optional nixl transport beyond the conformance suite: processes that used it exit
cleanly (UCX's efa module used to crash every one at exit, rc 139, where Debian's
ibverbs-providers is installed), and a peer idle past UCX's keepalive is still served (an
agent nobody progresses stalls its peers; the transport's thread progresses it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("nixl_cu12", reason="the nixl transport needs `make nixl`")

PAIR = """
import time, uuid
import numpy as np
from tsukimi.config import Config, MetadataConfig, TransferConfig
from tsukimi.transfer import TransferEngine
url = f"memory://{uuid.uuid4().hex}"
cfg = Config(TransferConfig(transport="nixl", nixl=True), MetadataConfig(url=url))
with TransferEngine("owner", cfg) as owner, TransferEngine("user", cfg) as user:
    buf = owner.allocate(1 << 20)
    user.write("owner", buf.base, b"first")
    time.sleep(IDLE_S)  # past the keepalive interval: the owner's agent must have been progressed
    started = time.monotonic()
    user.write("owner", buf.base + 8, b"after idling")
    back = bytearray(20)
    user.read("owner", buf.base + 8, back)
    assert bytes(back[:12]) == b"after idling", back
    print(f"ok {time.monotonic() - started:.3f}")
"""


def _run(idle_s: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(PAIR).replace("IDLE_S", str(idle_s))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_a_process_that_used_nixl_exits_cleanly() -> None:
    done = _run(0.0, {})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


def test_a_peer_idle_past_the_keepalive_is_still_served() -> None:
    done = _run(3.0, {"UCX_KEEPALIVE_INTERVAL": "0.5s"})
    assert done.returncode == 0, done.stderr[-2000:]
    seconds = float(done.stdout.split()[1])
    assert seconds < 2.0, done.stdout
