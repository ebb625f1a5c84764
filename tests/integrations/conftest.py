"""Markers of the integration tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "instances(*NAME=ROLE, **options): the fake vLLM instances behind the router")
