"""The proxy's clients share one TLS context, built the way httpx builds its default one."""

from __future__ import annotations

import ssl

import certifi
import pytest

from proxy.relay.tls import client_ssl_context


def test_the_context_is_built_once_and_verifies_certificates() -> None:
    ctx = client_ssl_context()
    assert client_ssl_context() is ctx, "a second client read the CA bundle again"
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_with_trust_env_a_changed_ssl_cert_file_gets_its_own_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    plain = client_ssl_context(trust_env=True)
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    from_env = client_ssl_context(trust_env=True)
    assert from_env is not plain, "SSL_CERT_FILE set after the first client was ignored"
    assert client_ssl_context(trust_env=True) is from_env
    assert client_ssl_context() is not from_env, "without trust_env the variable must not matter"
