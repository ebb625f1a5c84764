"""One store semantics suite, run against every deployment shape: in-process, and master +
holders as real processes.

The suite itself is tsukimi.testing.store_checks; each check is its own test here, per
deployment shape. One deployment per shape serves every check (a multi-process one takes
seconds to start); each check removes what it stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tsukimi.testing.assertions import check_name
from tsukimi.testing.deployments import DEPLOYMENT_KINDS, Deployment, DeploymentMaker, lend, start_deployment
from tsukimi.testing.store_checks import STORE_CHECKS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=DEPLOYMENT_KINDS, scope="module")
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    with start_deployment(request.param) as dep:
        yield dep


@pytest.mark.parametrize("check", STORE_CHECKS, ids=check_name)
def test_store(deployment: Deployment, check: Callable[[DeploymentMaker], None]) -> None:
    check(lend(deployment))
