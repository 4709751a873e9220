"""The servers of the client suite: started once for the folder (see ``servers.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .servers import Servers, running_servers


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with running_servers() as running:
        yield running
