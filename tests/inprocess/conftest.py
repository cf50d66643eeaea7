"""The in-process tier's shared fixture: deployments of the three role models in this process."""

from __future__ import annotations

import pytest

from tests.inprocess.fake_triton import Server


@pytest.fixture
def serve_model(tmp_path):
    """serve_model(model, **decode config fields) -> a `Server` of `model`; every one is closed after the test."""
    servers = []

    def start(model, **decode) -> Server:
        servers.append(Server(tmp_path, str(model), decode=decode))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
