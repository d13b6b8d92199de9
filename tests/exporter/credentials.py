"""Real credentials for the TLS and basic-auth tests: certificates made with the ``openssl``
command line, bcrypt hashes as ``htpasswd`` writes them."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from support import need_tool


def _openssl(*args: str | Path) -> None:
    subprocess.run(
        [need_tool("openssl"), *map(str, args)], check=True, capture_output=True, timeout=60
    )


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def make_ca(directory: Path, name: str = "ca") -> Pair:
    """A self-signed CA (EC P-256, valid a day)."""
    pair = Pair(directory / f"{name}.crt", directory / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", pair.key, "-out", pair.cert, "-days", "1", "-subj", f"/CN=ampscope test {name}",
    )  # fmt: skip
    return pair


def make_leaf(directory: Path, name: str, ca: Pair, sans: str, *, client: bool = False) -> Pair:
    """A certificate signed by ``ca`` with ``sans`` (``DNS:localhost,IP:127.0.0.1``)."""
    pair = Pair(directory / f"{name}.crt", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    usage = "clientAuth" if client else "serverAuth"
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", pair.key, "-out", csr, "-subj", f"/CN={name}",
        "-addext", f"subjectAltName={sans}", "-addext", f"extendedKeyUsage={usage}",
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-out", pair.cert, "-days", "1", "-copy_extensions", "copy",
    )  # fmt: skip
    return pair


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""

    ca: Pair
    server: Pair
    client: Pair
    directory: Path


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    server = make_leaf(directory, "server", ca, "DNS:localhost,IP:127.0.0.1")
    client = make_leaf(directory, "rank", ca, "DNS:rank.ampscope.test", client=True)
    return Pki(ca=ca, server=server, client=client, directory=directory)


def bcrypt_hash(password: str, cost: int = 4) -> str:
    """A ``$2y$`` hash, as ``htpasswd -nBC`` writes (cost 4 keeps tests fast)."""
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()
    return "$2y$" + hashed[4:]
