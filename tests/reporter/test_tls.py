"""The rank side's TLS settings and its refusals put into words (no server needed)."""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path

import pytest

from ampscope.reporter.tls import ClientTls, explain_401, explain_tls_failure, token_from_env


def test_token_file_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AMPSCOPE_TOKEN", "from-env")
    monkeypatch.delenv("AMPSCOPE_TOKEN_FILE", raising=False)
    assert token_from_env() == "from-env"
    (tmp_path / "token").write_text("  from-file\n")
    monkeypatch.setenv("AMPSCOPE_TOKEN_FILE", str(tmp_path / "token"))
    assert token_from_env() == "from-file"
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        token_from_env()
    monkeypatch.setenv("AMPSCOPE_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="cannot read AMPSCOPE_TOKEN_FILE"):
        token_from_env()


def test_client_tls_from_env_and_its_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AMPSCOPE_CA_FILE", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("AMPSCOPE_KEY_FILE", str(tmp_path / "rank.key"))
    monkeypatch.delenv("AMPSCOPE_CERT_FILE", raising=False)
    tls = ClientTls.from_env()
    assert (tls.ca_file, tls.cert_file) == (str(tmp_path / "ca.crt"), None)
    with pytest.raises(ValueError, match="without AMPSCOPE_CERT_FILE"):
        tls.context()
    with pytest.raises(ValueError, match="cannot load the CA file"):
        ClientTls(ca_file=str(tmp_path / "ca.crt")).context()
    context = ClientTls().context()
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname


def test_401_challenges_in_words() -> None:
    assert explain_401('Bearer realm="ampscope"').startswith("no token sent")
    wrong = 'Bearer realm="ampscope", error="invalid_token", error_description="wrong token"'
    assert explain_401(wrong).startswith("wrong token")
    assert "basic-auth" in explain_401('Basic realm="ampscope"')


def test_tls_failures_in_words() -> None:
    untrusted = ssl.SSLCertVerificationError(1, "certificate verify failed")
    untrusted.verify_message = "self-signed certificate in certificate chain"
    assert "untrusted server certificate" in (
        explain_tls_failure(untrusted, fresh=True, client_cert=False) or ""
    )
    alert = ssl.SSLError(1, "tlsv13 alert certificate required")
    alert.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert "requires a client certificate" in (
        explain_tls_failure(alert, fresh=True, client_cert=False) or ""
    )
    # TLS 1.3: a refused certificate can show only as a dropped first request.
    dropped = http.client.RemoteDisconnected("Remote end closed connection without response")
    assert "refused our client certificate" in (
        explain_tls_failure(dropped, fresh=True, client_cert=True) or ""
    )
    # A kept-alive connection closed by the server is not a refusal.
    assert explain_tls_failure(dropped, fresh=False, client_cert=True) is None
    assert explain_tls_failure(TimeoutError("timed out"), fresh=True, client_cert=False) is None
