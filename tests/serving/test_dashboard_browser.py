"""The dashboard in a real headless browser: Debian's chromium driven by Selenium through
/usr/bin/chromedriver, against a live `tsukimi up --model tiny` (PD: master, prefill and decode
workers, router; real processes). The page must show what the router did: request and token
counters that grow by what was sent, the decisions with our request ids and the workers' names,
the workers' and the pool's tables, three charts. `tsukimi top --once` shows the same cluster.

A missing browser fails (with how to install it), never skips: `make system-deps` installs
chromium and chromium-driver. TSUKIMI_UPDATE_SCREENSHOT=1 writes the screenshot the README shows
(docs/img/dashboard.png); otherwise it goes to the test's temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.test_cluster import running, tiny_cluster
from tsukimi.testing.processes import wait_until

pytestmark = pytest.mark.timeout(180)
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
# NOTE: the machine's network is closed: Chromium's background connections would be refused
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1200",
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `tsukimi up --model tiny` cluster (PD); its API's base URL."""
    tmp_path = tmp_path_factory.mktemp("up")
    config = tiny_cluster(tmp_path).replace("num_blocks = 64", "num_blocks = 512")  # NOTE: no kv_memory rejection
    with running(tmp_path, config, timeout_s=90) as state:
        yield str(state["api"])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (Selenium WebDriver) with a fresh profile."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(
            f"the dashboard's browser test needs {' and '.join(missing)}: "
            "apt-get install -y chromium chromium-driver (or `make system-deps`)",
            pytrace=False,
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the dashboard's browser test needs selenium: pip install -e '.[dev]'", pytrace=False)
    with tempfile.TemporaryDirectory(prefix="tsukimi-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*FLAGS, f"--user-data-dir={profile}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            driver.set_page_load_timeout(30)
            yield driver
        finally:
            driver.quit()


def text(driver: Any, element_id: str) -> str:
    return str(driver.execute_script(f"return document.getElementById('{element_id}').textContent"))


def number(driver: Any, element_id: str) -> int:
    value = text(driver, element_id).replace(",", "")
    return int(value) if value.isdigit() else -1


def rows(driver: Any, table_id: str) -> list[str]:
    script = f"return [...document.querySelectorAll('#{table_id} tbody tr')].map(r => r.innerText)"
    return [str(r) for r in driver.execute_script(script)]


def complete(api: str, request_id: str, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{api}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=60)
    assert response.status_code == 200, response.text


def test_the_page_follows_the_cluster(browser: Any, api: str, tmp_path: Path) -> None:
    browser.get(f"{api}/dashboard")
    wait_until(lambda: text(browser, "status") == "live" and number(browser, "requests-ok") >= 0, 30)
    ok, generated = number(browser, "requests-ok"), number(browser, "completion-tokens")
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 3
    update = bool(os.environ.get("TSUKIMI_UPDATE_SCREENSHOT"))
    ids = [f"dash-{i}" for i in range(3 * (12 if update else 4))]  # NOTE: fuller charts for the README
    with ThreadPoolExecutor(3) as pool:  # NOTE: in waves, so that the charts get several points
        for start in range(0, len(ids), 3):
            list(pool.map(lambda rid: complete(api, rid, shared + rid), ids[start : start + 3]))
    wait_until(lambda: number(browser, "requests-ok") == ok + len(ids), 30)
    wait_until(lambda: number(browser, "completion-tokens") == generated + len(ids) * 5, 10)
    decisions = rows(browser, "decisions")
    assert any("dash-" in row and "prefill-0" in row and "decode-0" in row for row in decisions), decisions
    assert {r.split()[0] for r in rows(browser, "workers")} == {"prefill-0", "decode-0"}
    assert all("\tup\t" in r for r in rows(browser, "workers")), rows(browser, "workers")
    assert len(rows(browser, "segments")) == 2  # the two workers' memory in the pool
    assert text(browser, "hit-ratio").endswith("%") and text(browser, "ttft-p50").endswith("ms")
    assert browser.execute_script("return document.querySelectorAll('.uplot canvas').length") == 3
    browser.set_window_size(1400, browser.execute_script("return document.documentElement.scrollHeight") + 140)
    out = SCREENSHOT if update else tmp_path / "dashboard.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(out)) and out.stat().st_size > 10_000


def test_top_once_prints_the_same_cluster(api: str) -> None:
    complete(api, "top-0", "Hello there")
    # NOTE: the dashboard publishes a snapshot once a second: wait for one that saw the request
    wait_until(lambda: '"top-0"' in httpx.get(f"{api}/dashboard/api/snapshot", timeout=5).text, 10)
    env = {**os.environ, "COLUMNS": "160"}
    cmd = [sys.executable, "-m", "tsukimi.cli", "top", "--url", api, "--once"]
    deadline = time.monotonic() + 30
    while True:  # NOTE: the router samples its snapshot once a second: the request shows up by the next one
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=True).stdout
        if "top-0" in out or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "tsukimi router (pd) tiny" in out and "prefill-0" in out and "decode-0" in out, out
    assert "top-0" in out and "KV pool at tcp://127.0.0.1:" in out and "objects" in out, out
