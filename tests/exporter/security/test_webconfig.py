"""The exporter-toolkit web config: what is accepted, what is refused and why."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import yaml

from ampscope.exporter.security.tls import build_context
from ampscope.exporter.security.webconfig import WebConfigError, load
from exporter.credentials import Pki, bcrypt_hash, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("webconfig") / "pki")


def _write(directory: Path, document: Any) -> Path:
    path = directory / "web-config.yml"
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def _tls(pki: Pki, **extra: Any) -> dict[str, Any]:
    return {
        "tls_server_config": {
            "cert_file": "pki/server.crt",
            "key_file": "pki/server.key",
            **extra,
        }
    }


def _load_all(path: Path) -> None:
    """What ``ampscope serve`` does before binding: parse, then load the certificates."""
    config = load(path)
    if config.tls is not None:
        build_context(config.tls)


def _error(path: Path) -> WebConfigError:
    with pytest.raises(WebConfigError) as caught:
        _load_all(path)
    return caught.value


def test_empty_file_is_plain_http_with_open_reads(tmp_path: Path) -> None:
    config = load(_write(tmp_path, ""))
    assert (config.tls, dict(config.headers), dict(config.users)) == (None, {}, {})
    assert load(_write(tmp_path, {"tls_server_config": {}})).tls is None


def test_full_config_resolves_paths_against_the_files_directory(pki: Pki) -> None:
    hashed = bcrypt_hash("pw")
    path = _write(
        pki.directory.parent,
        {
            **_tls(
                pki,
                client_auth_type="RequireAndVerifyClientCert",
                client_ca_file="pki/ca.crt",
                client_allowed_sans=["rank.ampscope.test"],
                min_version="TLS12",
                max_version="TLS13",
                cipher_suites=["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"],
                prefer_server_cipher_suites=False,
                curve_preferences=["CurveP256"],
            ),
            "http_server_config": {
                "http2": False,
                "headers": {"X-Frame-Options": "deny", "X-XSS-Protection": ""},
            },
            "basic_auth_users": {"prometheus": hashed},
        },
    )
    config = load(path)
    assert config.tls is not None
    assert config.tls.cert_file == pki.server.cert
    assert config.tls.client_ca_file == pki.ca.cert
    assert dict(config.headers) == {"X-Frame-Options": "deny"}, "blank means unset"
    assert dict(config.users) == {"prometheus": hashed}
    context = build_context(config.tls)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.allowed_sans == frozenset({"rank.ampscope.test"})
    tls12 = {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 == {"ECDHE-ECDSA-AES128-GCM-SHA256"}
    assert not context.options & ssl.OP_CIPHER_SERVER_PREFERENCE


def test_client_auth_types_map_to_verify_modes(pki: Pki) -> None:
    modes = {
        "NoClientCert": ssl.CERT_NONE,
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }
    for name, mode in modes.items():
        extra = {} if name == "NoClientCert" else {"client_ca_file": "pki/ca.crt"}
        config = load(_write(pki.directory.parent, _tls(pki, client_auth_type=name, **extra)))
        assert config.tls is not None
        assert build_context(config.tls).verify_mode == mode, name


@pytest.mark.parametrize(
    ("document", "key", "reason"),
    [
        ({"tls_server_config": {"client_auth_type": "RequestClientCert"}}, "client_auth_type",
         "cannot do"),
        ({"client_auth_type": "RequireAnyClientCert"}, "client_auth_type", "unverified"),
        ({"client_auth_type": "RequireClientCert"}, "client_auth_type", "unverified"),
        ({"client_auth_type": "Sometimes"}, "client_auth_type", "invalid ClientAuth"),
        ({"client_auth_type": "RequireAndVerifyClientCert"}, "client_ca_file", "needs"),
        ({"client_ca_file": "pki/ca.crt"}, "client_auth_type", "without a client auth"),
        ({"cipher_suites": ["TLS_AES_128_GCM_SHA256"]}, "cipher_suites", "TLS 1.3 suite"),
        ({"cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}, "cipher_suites", "unknown cipher"),
        ({"min_version": "TLS13", "cipher_suites": ["TLS_RSA_WITH_AES_128_CBC_SHA"]},
         "cipher_suites", "no effect"),
        ({"curve_preferences": ["X25519", "CurveP256"]}, "curve_preferences", "several"),
        ({"curve_preferences": ["CurveP224"]}, "curve_preferences", "unknown curve"),
        ({"min_version": "TLS11"}, "min_version", "refused"),
        ({"min_version": "TLS14"}, "min_version", "unknown TLS version"),
        ({"min_version": "TLS13", "max_version": "TLS12"}, "max_version", "below"),
        ({"cert": "-----BEGIN CERTIFICATE-----"}, "cert", "files only"),
        ({"client_allowed_sans": ["x"], "client_auth_type": "VerifyClientCertIfGiven",
          "client_ca_file": "pki/ca.crt"}, "client_allowed_sans", "RequireAndVerify"),
        ({"unknown": 1}, "tls_server_config.unknown", "unknown key"),
        ({"cert_file": "pki/missing.crt"}, "cert_file", "cannot load"),
        ({"key_file": "pki/ca.key"}, "cert_file", "cannot load"),
        ({"client_auth_type": "VerifyClientCertIfGiven", "client_ca_file": "pki/server.key"},
         "client_ca_file", "cannot load"),
    ],
)  # fmt: skip
def test_tls_settings_refused_with_key_and_reason(
    pki: Pki, document: dict[str, Any], key: str, reason: str
) -> None:
    section = document.get("tls_server_config", document)
    error = _error(_write(pki.directory.parent, _tls(pki, **section)))
    assert error.key.endswith(key), error
    assert reason in error.reason, error


@pytest.mark.parametrize(
    ("document", "key", "reason"),
    [
        ({"http_server_config": {"http2": True}}, "http_server_config.http2", "HTTP/1.1 only"),
        ({"http_server_config": {"headers": {"Server": "x"}}},
         "http_server_config.headers.Server", "can not be configured"),
        ({"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
         "http_server_config.headers.X-Frame-Options", "expected one of"),
        ({"basic_auth_users": {"alice": "plaintext"}}, "basic_auth_users.alice", "bcrypt hash"),
        ({"basic_auth_users": {"a:b": bcrypt_hash("x")}}, "basic_auth_users.a:b", "':'"),
        ({"rate_limit": {"burst": 1}}, "rate_limit", "not supported"),
        ({"tls_config": {}}, "tls_config", "unknown key"),
        ("basic_auth_users: {a: x}\nbasic_auth_users: {}\n", "basic_auth_users", "twice"),
        ("tls_server_config: [", "web_config_file", "not valid YAML"),
        ("- a list", "web_config_file", "mapping"),
    ],
)  # fmt: skip
def test_other_settings_refused_with_key_and_reason(
    tmp_path: Path, document: Any, key: str, reason: str
) -> None:
    error = _error(_write(tmp_path, document))
    assert (error.key, reason in error.reason) == (key, True), error


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    error = _error(tmp_path / "absent.yml")
    assert error.key == "web_config_file"
    assert "absent.yml" in error.reason


def test_header_values_yaml_reads_as_numbers_or_booleans_are_their_text(tmp_path: Path) -> None:
    # The exporter-toolkit's own web/testdata/web_config_headers.good.yml.
    toolkit = (
        "http_server_config:\n"
        "  headers:\n"
        "    X-Frame-Options: deny\n"
        "    Strict-Transport-Security: max-age=31536000; includeSubDomains\n"
        "    X-Content-Type-Options: nosniff\n"
        "    X-XSS-Protection: 1\n"
        "    Content-Security-Policy: \"default-src 'self' *.test.example.net\"\n"
    )
    assert dict(load(_write(tmp_path, toolkit)).headers) == {
        "X-Frame-Options": "deny",
        "Strict-Transport-Security": "max-age=31536000; includeSubDomains",
        "X-Content-Type-Options": "nosniff",
        "X-XSS-Protection": "1",
        "Content-Security-Policy": "default-src 'self' *.test.example.net",
    }
    # As written, not as YAML 1.1 reads it (0o10, 1.0, True) nor as Python prints it.
    for written in ("010", "1.0", "yes", "true", "0"):
        document = f"http_server_config:\n  headers:\n    X-XSS-Protection: {written}\n"
        assert dict(load(_write(tmp_path, document)).headers) == {"X-XSS-Protection": written}
    # null is Go's empty string: the header stays unset; a list is no header value.
    document = "http_server_config:\n  headers:\n    X-XSS-Protection:\n"
    assert dict(load(_write(tmp_path, document)).headers) == {}
    document = "http_server_config:\n  headers:\n    X-XSS-Protection: [1]\n"
    error = _error(_write(tmp_path, document))
    assert error.key == "http_server_config.headers.X-XSS-Protection"
    assert "must be a string" in error.reason


@pytest.mark.parametrize(
    ("section", "ignored"),
    [
        ({"min_version": "TLS12", "prefer_server_cipher_suites": False},
         ("min_version", "prefer_server_cipher_suites")),
        # Valid names the toolkit decodes, though ampscope refuses them where TLS is served.
        ({"min_version": "TLS10", "cipher_suites": ["TLS_AES_128_GCM_SHA256"]},
         ("min_version", "cipher_suites")),
        ({"max_version": "TLS13", "curve_preferences": ["X25519", "CurveP256"],
          "client_allowed_sans": ["rank.ampscope.test"]},
         ("max_version", "curve_preferences", "client_allowed_sans")),
        ({"cert_file": "", "key_file": ""}, ("cert_file", "key_file")),
    ],
)  # fmt: skip
def test_tls_without_an_enabling_key_is_plain_http_as_in_the_toolkit(
    tmp_path: Path, section: dict[str, Any], ignored: tuple[str, ...]
) -> None:
    config = load(_write(tmp_path, {"tls_server_config": section}))
    assert config.tls is None
    assert sorted(config.tls_ignored) == sorted(ignored)  # in the file's order


@pytest.mark.parametrize(
    ("section", "key", "reason"),
    [
        ({"min_version": "TLS14"}, "min_version", "unknown TLS version: TLS14"),
        ({"cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}, "cipher_suites", "unknown cipher"),
        ({"curve_preferences": ["CurveP224"]}, "curve_preferences", "unknown curve"),
        ({"prefer_server_cipher_suites": "maybe"}, "prefer_server_cipher_suites", "true or false"),
        ({"min_version": "TLS12", "typo": 1}, "typo", "unknown key"),
        # Any enabling key means TLS, which then needs its certificate (the toolkit's
        # "missing one of cert or cert_file").
        ({"client_auth_type": "NoClientCert", "min_version": "TLS12"}, "cert_file", "missing"),
        ({"key_file": "pki/server.key"}, "cert_file", "missing"),
    ],
)  # fmt: skip
def test_tls_without_an_enabling_key_still_checks_its_keys(
    tmp_path: Path, section: dict[str, Any], key: str, reason: str
) -> None:
    error = _error(_write(tmp_path, {"tls_server_config": section}))
    assert error.key == f"tls_server_config.{key}", error
    assert reason in error.reason, error


def test_a_bcrypt_hash_must_be_the_whole_value_and_one_bcrypt_checks(tmp_path: Path) -> None:
    hashed = bcrypt_hash("pw")  # $2y$
    for prefix in ("$2a$", "$2b$", "$2y$"):
        users = load(_write(tmp_path, {"basic_auth_users": {"alice": prefix + hashed[4:]}})).users
        assert dict(users) == {"alice": prefix + hashed[4:]}
    # A block scalar keeps its line break: every login would fail against it.
    block = f"basic_auth_users:\n  alice: |\n    {hashed}\n"
    error = _error(_write(tmp_path, block))
    assert error.key == "basic_auth_users.alice"
    assert "ends with a line break" in error.reason
    assert dict(load(_write(tmp_path, block.replace("|", "|-"))).users) == {"alice": hashed}
    for prefix in ("$2$", "$2x$"):
        error = _error(_write(tmp_path, {"basic_auth_users": {"bob": prefix + hashed[4:]}}))
        assert error.key == "basic_auth_users.bob"
        assert f"the prefix {prefix} cannot be checked" in error.reason
    error = _error(_write(tmp_path, {"basic_auth_users": {"carol": hashed + "x"}}))
    assert (error.key, "must be a bcrypt hash" in error.reason) == ("basic_auth_users.carol", True)
