"""Fixtures for the integration tests (the `box` factory lives in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
        yield client
