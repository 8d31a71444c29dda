"""Fixtures for the integration tests (the `box` factory lives in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.integration.boxes import LOOPBACK_TLS


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=LOOPBACK_TLS, timeout=30.0, trust_env=False) as client:
        yield client
