"""Bytes inside the proxy; GiB and MiB only at the configuration edge (and in text for people)."""

from __future__ import annotations

GIB = 2**30
MIB = 2**20
