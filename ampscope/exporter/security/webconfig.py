"""The exporter-toolkit web configuration file (``--web-config-file``), parsed strictly.

The format is the one node_exporter, the Pushgateway and DCGM-exporter read with
``--web.config.file`` (prometheus/exporter-toolkit, ``docs/web-configuration.md``): unknown
keys and duplicate keys are errors, as with Go's ``yaml.UnmarshalStrict``; a string setting
given as a YAML number or boolean (``X-XSS-Protection: 1``) is its text, as Go decodes it;
a ``tls_server_config`` without any of the keys that enable TLS (the toolkit's
``IsEnabled``: cert, key, client CA or client auth type) means plain HTTP; relative paths
are resolved against the file's own directory. What Python's ``ssl`` (or uvicorn) cannot do
is refused with the reason, never ignored: a setting that silently does nothing is worse
than an exporter that will not start.

Parsing reads no certificate; ``ampscope.exporter.security.tls.build_context`` loads them. Standard
library and PyYAML only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

ClientAuth = Literal["NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"]
TlsVersion = Literal["TLS12", "TLS13"]


class WebConfigError(ValueError):
    """The file is unreadable or invalid. ``key`` is the dotted path of the culprit."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class TlsServerConfig:
    """``tls_server_config``, with every path absolute."""

    cert_file: Path
    key_file: Path
    client_auth_type: ClientAuth = "NoClientCert"
    client_ca_file: Path | None = None
    client_ca: str | None = None
    """PEM text of the client CA(s), inline (the toolkit's ``client_ca``)."""
    client_allowed_sans: tuple[str, ...] = ()
    """A client certificate must carry one of these SANs (DNS, IP, e-mail or URI)."""
    min_version: TlsVersion = "TLS12"
    max_version: TlsVersion = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    """Go names of TLS 1.2 suites, in preference order; empty: OpenSSL's defaults."""
    prefer_server_cipher_suites: bool = True
    curve: str | None = None
    """The one ``curve_preferences`` entry (Go name), when given."""


@dataclass(frozen=True, kw_only=True)
class WebConfig:
    """One parse of the web configuration file."""

    path: Path
    tls: TlsServerConfig | None = None
    """``None``: plain HTTP (the toolkit's behaviour without ``tls_server_config``)."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Added to every response; blank values are left out (unset)."""
    users: Mapping[str, str] = field(default_factory=dict)
    """User name -> bcrypt hash. Empty: reads need no password."""
    tls_ignored: tuple[str, ...] = ()
    """``tls_server_config`` keys given without a key that enables TLS: valid, and without
    effect (plain HTTP, as with the toolkit)."""


# The toolkit's extraHTTPHeaders: the only headers it lets a file set, and the values of
# those that are enumerations.
ALLOWED_HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}

# Go's crypto/tls CipherSuites() (the secure list the toolkit accepts) -> OpenSSL names.
TLS12_CIPHERS: dict[str, str] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
}
TLS13_CIPHERS = frozenset(
    {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
)
# The toolkit's curve names -> OpenSSL's.
CURVES: dict[str, str] = {
    "CurveP256": "prime256v1",
    "CurveP384": "secp384r1",
    "CurveP521": "secp521r1",
    "X25519": "X25519",
}
_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")
_REFUSED_CLIENT_AUTH = {
    "RequestClientCert": "asks for a certificate and accepts it unverified",
    "RequireAnyClientCert": "requires a certificate but accepts it unverified",
    "RequireClientCert": "(the old name of RequireAnyClientCert) accepts it unverified",
}
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
"""Matched against the whole value: the prefixes bcrypt checks, a cost, salt and hash."""
_BCRYPT_PREFIX = re.compile(r"\$2[a-z]?\$")

_ENABLING_TLS_KEYS = (
    "cert_file", "cert", "key_file", "key", "client_ca_file", "client_ca", "client_auth_type",
)  # fmt: skip
"""The toolkit's ``TLSConfig.IsEnabled``: any of these non-empty means TLS."""

_TLS_KEYS = frozenset(
    {
        "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type",
        "client_ca_file", "client_allowed_sans", "min_version", "max_version",
        "cipher_suites", "prefer_server_cipher_suites", "curve_preferences",
    }
)  # fmt: skip


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (Go's strict decoding does too)."""


class _Mapping(dict[Any, Any]):
    """A YAML mapping that keeps the text of its scalar values: Go's yaml decodes any scalar
    (``1``, ``true``) into a string setting as the text it was written as."""

    texts: dict[Any, str]


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    texts: dict[Any, str] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise WebConfigError(str(key), f"given twice (line {key_node.start_mark.line + 1})")
        seen.add(key)
        if isinstance(value_node, yaml.ScalarNode):
            texts[key] = value_node.value
    mapping = _Mapping(loader.construct_mapping(node))
    mapping.texts = texts
    return mapping


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load(path: Path) -> WebConfig:
    """Read and validate the web configuration file at ``path``.

    Raises:
        WebConfigError: naming the key and the reason, for anything the toolkit would
            reject and for settings ampscope cannot honour.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WebConfigError("web_config_file", f"cannot read {path}: {exc}") from None
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no object construction
    except yaml.YAMLError as exc:
        raise WebConfigError("web_config_file", f"{path} is not valid YAML: {exc}") from None
    return parse(document if document is not None else {}, base=path.resolve().parent, path=path)


def parse(document: Any, *, base: Path, path: Path) -> WebConfig:
    """Validate a decoded YAML document; relative paths are joined to ``base``."""
    top = _dict(document, "web_config_file")
    for key in top:
        if key not in ("tls_server_config", "http_server_config", "basic_auth_users"):
            if key == "rate_limit":
                raise WebConfigError(
                    key, "not supported by ampscope; --max-connections bounds the load"
                )
            raise WebConfigError(str(key), "unknown key")
    tls_section = _dict(top.get("tls_server_config") or {}, "tls_server_config")
    # Without a key that enables TLS the toolkit serves plain HTTP (TLSConfig.IsEnabled),
    # whatever else the section sets; the other keys must still be valid.
    enabled = any(_str(tls_section, key, "tls_server_config") for key in _ENABLING_TLS_KEYS)
    return WebConfig(
        path=path,
        tls=_tls(tls_section, base) if enabled else None,
        headers=_http(_dict(top.get("http_server_config") or {}, "http_server_config")),
        users=_users(top.get("basic_auth_users") or {}),
        tls_ignored=() if enabled else _not_enabling(tls_section),
    )


def _dict(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WebConfigError(key, f"must be a mapping, not {type(value).__name__}")
    for name in value:
        if not isinstance(name, str):
            raise WebConfigError(f"{key}.{name}", "keys must be strings")
    return value


def _str(section: dict[str, Any], key: str, where: str) -> str | None:
    value = section.get(key)
    if value is None:
        return None
    texts: dict[Any, str] = getattr(section, "texts", {})
    if isinstance(value, bool | int | float) and key in texts:
        return texts[key]  # a YAML number or boolean: the text it was written as
    if not isinstance(value, str):
        raise WebConfigError(f"{where}.{key}", f"must be a string, not {value!r}")
    return value


def _strings(section: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = section.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WebConfigError(f"{where}.{key}", "must be a list of strings")
    return tuple(value)


def _path(section: dict[str, Any], key: str, base: Path) -> Path | None:
    value = _str(section, key, "tls_server_config")
    return None if not value else base / value


def _version(section: dict[str, Any], key: str, default: TlsVersion) -> TlsVersion:
    value = _str(section, key, "tls_server_config") or default
    where = f"tls_server_config.{key}"
    if value not in _VERSIONS:
        raise WebConfigError(where, f"unknown TLS version {value!r} (TLS12 or TLS13)")
    if value in ("TLS10", "TLS11"):
        raise WebConfigError(
            where, f"{value} is refused: this Python's OpenSSL disables TLS 1.0 and 1.1"
        )
    return "TLS13" if value == "TLS13" else "TLS12"


def _tls(section: dict[str, Any], base: Path) -> TlsServerConfig:
    where = "tls_server_config"
    for key in section:
        if key not in _TLS_KEYS:
            raise WebConfigError(f"{where}.{key}", "unknown key")
    for inline in ("cert", "key"):
        if section.get(inline):
            raise WebConfigError(
                f"{where}.{inline}",
                f"inline PEM is refused: Python's ssl loads a certificate and its key from "
                f"files only; use {inline}_file",
            )
    cert_file, key_file = _path(section, "cert_file", base), _path(section, "key_file", base)
    if cert_file is None:
        raise WebConfigError(f"{where}.cert_file", "missing (TLS needs cert_file and key_file)")
    if key_file is None:
        raise WebConfigError(f"{where}.key_file", "missing (TLS needs cert_file and key_file)")
    client_auth = _client_auth(_str(section, "client_auth_type", where) or "NoClientCert")
    client_ca_file = _path(section, "client_ca_file", base)
    client_ca = _str(section, "client_ca", where) or None
    if client_ca_file is not None and client_ca is not None:
        raise WebConfigError(f"{where}.client_ca", "give client_ca or client_ca_file, not both")
    has_ca = client_ca_file is not None or client_ca is not None
    if has_ca and client_auth == "NoClientCert":
        raise WebConfigError(
            f"{where}.client_auth_type",
            "client CAs are configured without a client auth policy (NoClientCert)",
        )
    if not has_ca and client_auth != "NoClientCert":
        raise WebConfigError(
            f"{where}.client_ca_file",
            f"{client_auth} needs client_ca_file (or client_ca): ampscope verifies client "
            "certificates against your CA, never against the system's public ones",
        )
    sans = _strings(section, "client_allowed_sans", where)
    if sans and client_auth != "RequireAndVerifyClientCert":
        raise WebConfigError(
            f"{where}.client_allowed_sans", "requires client_auth_type RequireAndVerifyClientCert"
        )
    min_version = _version(section, "min_version", "TLS12")
    max_version = _version(section, "max_version", "TLS13")
    if min_version == "TLS13" and max_version == "TLS12":
        raise WebConfigError(f"{where}.max_version", "is below min_version")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError(f"{where}.prefer_server_cipher_suites", "must be true or false")
    return TlsServerConfig(
        cert_file=cert_file,
        key_file=key_file,
        client_auth_type=client_auth,
        client_ca_file=client_ca_file,
        client_ca=client_ca,
        client_allowed_sans=sans,
        min_version=min_version,
        max_version=max_version,
        cipher_suites=_ciphers(_strings(section, "cipher_suites", where), min_version),
        prefer_server_cipher_suites=prefer,
        curve=_curve(_strings(section, "curve_preferences", where)),
    )


def _not_enabling(section: dict[str, Any]) -> tuple[str, ...]:
    """The keys a section without TLS sets, each checked as the toolkit decodes it (a known
    version, cipher or curve name; ampscope's own refusals need TLS to apply)."""
    where = "tls_server_config"
    for key in section:
        if key not in _TLS_KEYS:
            raise WebConfigError(f"{where}.{key}", "unknown key")
    for key in ("min_version", "max_version"):
        value = _str(section, key, where)
        if value is not None and value not in _VERSIONS:
            raise WebConfigError(f"{where}.{key}", f"unknown TLS version: {value}")
    for name in _strings(section, "cipher_suites", where):
        if name not in TLS12_CIPHERS and name not in TLS13_CIPHERS:
            raise WebConfigError(f"{where}.cipher_suites", f"unknown cipher: {name}")
    for name in _strings(section, "curve_preferences", where):
        if name not in CURVES:
            raise WebConfigError(f"{where}.curve_preferences", f"unknown curve: {name}")
    _strings(section, "client_allowed_sans", where)
    prefer = section.get("prefer_server_cipher_suites")
    if prefer is not None and not isinstance(prefer, bool):
        raise WebConfigError(f"{where}.prefer_server_cipher_suites", "must be true or false")
    return tuple(key for key, value in section.items() if value is not None)


def _client_auth(value: str) -> ClientAuth:
    key = "tls_server_config.client_auth_type"
    if value in _REFUSED_CLIENT_AUTH:
        raise WebConfigError(
            key,
            f"{value} is refused: it {_REFUSED_CLIENT_AUTH[value]}, which Python's ssl cannot "
            "do; use RequireAndVerifyClientCert (or VerifyClientCertIfGiven) with client_ca_file",
        )
    if value == "NoClientCert":
        return "NoClientCert"
    if value == "VerifyClientCertIfGiven":
        return "VerifyClientCertIfGiven"
    if value == "RequireAndVerifyClientCert":
        return "RequireAndVerifyClientCert"
    raise WebConfigError(key, f"invalid ClientAuth: {value}")


def _ciphers(names: tuple[str, ...], min_version: TlsVersion) -> tuple[str, ...]:
    key = "tls_server_config.cipher_suites"
    for name in names:
        if name in TLS13_CIPHERS:
            raise WebConfigError(
                key,
                f"{name} is a TLS 1.3 suite: TLS 1.3 suites cannot be chosen (Go ignores "
                "them; ampscope refuses rather than ignore). List TLS 1.2 suites only",
            )
        if name not in TLS12_CIPHERS:
            raise WebConfigError(key, f"unknown cipher: {name}")
    if names and min_version == "TLS13":
        raise WebConfigError(
            key, "has no effect with min_version TLS13 (TLS 1.3 suites cannot be chosen)"
        )
    return names


def _curve(names: tuple[str, ...]) -> str | None:
    key = "tls_server_config.curve_preferences"
    for name in names:
        if name not in CURVES:
            raise WebConfigError(key, f"unknown curve: {name}")
    if len(names) > 1:
        raise WebConfigError(
            key,
            "several curves are refused: Python's ssl can restrict the key exchange to one "
            "curve only (ssl.SSLContext.set_ecdh_curve), not a preference list",
        )
    return names[0] if names else None


def _http(section: dict[str, Any]) -> dict[str, str]:
    where = "http_server_config"
    for key in section:
        if key not in ("http2", "headers"):
            raise WebConfigError(f"{where}.{key}", "unknown key")
    http2 = section.get("http2")
    if http2 is not None and not isinstance(http2, bool):
        raise WebConfigError(f"{where}.http2", "must be true or false")
    if http2:
        raise WebConfigError(
            f"{where}.http2",
            "true is refused: the exporter (uvicorn) speaks HTTP/1.1 only; remove the key or "
            "set it to false",
        )
    headers = _dict(section.get("headers") or {}, f"{where}.headers")
    result: dict[str, str] = {}
    for name in headers:
        key = f"{where}.headers.{name}"
        if name not in ALLOWED_HEADERS:
            raise WebConfigError(key, f"HTTP header {name!r} can not be configured")
        # null is Go's empty string: an unset header.
        value = _str(headers, name, f"{where}.headers") or ""
        allowed = ALLOWED_HEADERS[name]
        if allowed and value not in allowed:
            raise WebConfigError(key, f"expected one of {list(allowed)}, got {value!r}")
        if "\r" in value or "\n" in value:
            raise WebConfigError(key, "must be one line")
        if value:
            result[name] = value
    return result


def _users(value: Any) -> dict[str, str]:
    users = _dict(value, "basic_auth_users")
    for name, hashed in users.items():
        key = f"basic_auth_users.{name}"
        if ":" in name:
            raise WebConfigError(key, "a user name cannot contain ':' (HTTP basic auth)")
        if (
            isinstance(hashed, str)
            and hashed != hashed.rstrip()
            and _BCRYPT_HASH.fullmatch(hashed.rstrip())
        ):
            raise WebConfigError(
                key,
                "the bcrypt hash ends with a line break or space, which bcrypt would compare "
                "too, failing every login (a YAML block scalar '|' keeps the line break: use "
                "'|-', or put the hash on the user's line)",
            )
        prefix = _BCRYPT_PREFIX.match(hashed) if isinstance(hashed, str) else None
        if prefix is not None and prefix.group() not in ("$2a$", "$2b$", "$2y$"):
            raise WebConfigError(
                key,
                f"a bcrypt hash with the prefix {prefix.group()} cannot be checked (bcrypt "
                "implements $2a$, $2b$ and $2y$): hash the password again, e.g. with "
                "`htpasswd -nBC 10 \"\" | tr -d ':\\n'`",
            )
        match = _BCRYPT_HASH.fullmatch(hashed) if isinstance(hashed, str) else None
        if match is None:
            raise WebConfigError(
                key,
                "must be a bcrypt hash ($2y$10$..., from `htpasswd -nBC 10 \"\" | tr -d ':\\n'`)",
            )
        cost = int(match.group(1))
        if not 4 <= cost <= 31:
            raise WebConfigError(key, f"bcrypt cost {cost} is outside 4..31")
    return dict(users)
