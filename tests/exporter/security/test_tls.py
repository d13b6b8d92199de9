"""`ampscope serve --web-config-file` for real: TLS with client certificates, basic auth,
the rank side and the CLI against it, invalid files, rotation without restart."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import free_port, run_distributed, start_prometheus, stop_process, wait_until

from ampscope.reporter.http import HttpReporter
from ampscope.reporter.tls import ClientTls
from exporter.credentials import Pki, bcrypt_hash, make_leaf, make_pki
from exporter.factory import record

TOKEN = "rank-token-1"
PASSWORD = "scrape-pw"


@dataclass
class Exporter:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    config: Path
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _web_config(pki: Pki, directory: Path, **tls: Any) -> dict[str, Any]:
    relative = os.path.relpath(pki.directory, directory)
    return {
        "tls_server_config": {
            "cert_file": f"{relative}/server.crt",
            "key_file": f"{relative}/server.key",
            **tls,
        },
        "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
        "basic_auth_users": {"prometheus": bcrypt_hash(PASSWORD)},
    }


def _context(pki: Pki, *, cert: bool = True, ca: bool = True) -> ssl.SSLContext:
    return ClientTls(
        ca_file=str(pki.ca.cert) if ca else None,
        cert_file=str(pki.client.cert) if cert else None,
        key_file=str(pki.client.key) if cert else None,
    ).context()


def _get(url: str, context: ssl.SSLContext, auth: bool = True) -> Any:
    request = urllib.request.Request(url)
    if auth:
        credentials = base64.b64encode(f"prometheus:{PASSWORD}".encode()).decode()
        request.add_header("Authorization", f"Basic {credentials}")
    return urllib.request.urlopen(request, timeout=10, context=context)


def _start(directory: Path, config: dict[str, Any], pki: Pki) -> Exporter:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "web-config.yml"
    path.write_text(yaml.safe_dump(config))
    (directory / "token").write_text(TOKEN)
    port = free_port()
    log = directory / "exporter.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port),
         "--web-config-file", str(path), "--token-file", str(directory / "token")],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    exporter = Exporter(f"https://127.0.0.1:{port}", port, process, path, log)
    context = _context(pki)

    def up() -> bool:
        if process.poll() is not None:
            pytest.fail(f"exporter exited {process.returncode}: {exporter.log_text()}")
        try:
            return _get(exporter.url + "/healthz", context).status == 200
        except OSError:
            return False

    wait_until(up, "exporter answering over TLS")
    return exporter


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("tls") / "pki")


@pytest.fixture(scope="module")
def mtls(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exporter]:
    """An exporter requiring a verified client certificate, basic auth and the token."""
    directory = tmp_path_factory.mktemp("mtls")
    relative = os.path.relpath(pki.ca.cert, directory)
    config = _web_config(
        pki, directory, client_auth_type="RequireAndVerifyClientCert", client_ca_file=relative
    )
    exporter = _start(directory, config, pki)
    yield exporter
    stop_process(exporter.process)


def test_reads_need_the_certificate_and_the_password(mtls: Exporter, pki: Pki) -> None:
    with _get(mtls.url + "/metrics", _context(pki)) as response:
        assert response.status == 200
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert b"ampscope_exporter_ingest_rejections_total" in response.read()
    with pytest.raises(urllib.error.HTTPError) as refused:
        _get(mtls.url + "/metrics", _context(pki), auth=False)
    assert refused.value.code == 401
    assert refused.value.headers["WWW-Authenticate"].startswith("Basic")


def test_a_client_without_a_certificate_is_refused(mtls: Exporter, pki: Pki) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)) as refused:
        _get(mtls.url + "/healthz", _context(pki, cert=False)).read()
    # TLS 1.3: an alert, or a dropped connection, once the client thinks it is done.
    assert not isinstance(refused.value, urllib.error.HTTPError), refused.value


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AMPSCOPE_")}
    return subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "status", *args],
        env=clean | (env or {}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_says_why_it_was_refused(mtls: Exporter, pki: Pki, tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    tls = ["--url", mtls.url, "--ca-file", str(pki.ca.cert)]
    cert = ["--cert-file", str(pki.client.cert), "--key-file", str(pki.client.key)]
    untrusted = _status("--url", mtls.url, *cert)
    assert untrusted.returncode == 6, untrusted.stderr
    assert "untrusted server certificate" in untrusted.stderr
    no_cert = _status(*tls)
    assert no_cert.returncode == 6, no_cert.stderr
    assert "requires a client certificate" in no_cert.stderr
    no_password = _status(*tls, *cert)
    assert no_password.returncode == 5, no_password.stderr
    assert "basic-auth user and password" in no_password.stderr
    wrong = _status(*tls, *cert, "--user", "prometheus", env={"AMPSCOPE_PASSWORD": "nope"})
    assert wrong.returncode == 5, wrong.stderr
    ok = _status(*tls, *cert, "--user", "prometheus", "--password-file", str(password_file))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip(), "the table"


def test_status_over_several_exporters_gives_each_the_same_credentials(
    mtls: Exporter, pki: Pki, tmp_path: Path
) -> None:
    directory = tmp_path / "second"
    directory.mkdir()
    relative = os.path.relpath(pki.ca.cert, directory)
    config = _web_config(
        pki, directory, client_auth_type="RequireAndVerifyClientCert", client_ca_file=relative
    )
    second = _start(directory, config, pki)
    try:
        password_file = tmp_path / "password"
        password_file.write_text(PASSWORD + "\n")
        both = ["--url", mtls.url, "--url", second.url, "--ca-file", str(pki.ca.cert),
                "--cert-file", str(pki.client.cert), "--key-file", str(pki.client.key)]  # fmt: skip
        ok = _status(*both, "--json", "--user", "prometheus", "--password-file", str(password_file))
        assert ok.returncode == 0, ok.stderr
        targets = json.loads(ok.stdout)["targets"]
        assert [(t["url"], t["status"]) for t in targets] == [(mtls.url, "ok"), (second.url, "ok")]
        # Every target refuses a wrong password: the refusal's own exit status, each named.
        wrong = _status(*both, "--user", "prometheus", env={"AMPSCOPE_PASSWORD": "nope"})
        assert wrong.returncode == 5, wrong.stderr
        for url in (mtls.url, second.url):
            assert f"{url}: {url} refused the request (HTTP 401)" in wrong.stderr
    finally:
        stop_process(second.process)


def _said(caplog: pytest.LogCaptureFixture, why: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if why in r.getMessage()]


def _dropped_and_said(reporter: HttpReporter, caplog: pytest.LogCaptureFixture, why: str) -> bool:
    return reporter.dropped == 1 and bool(_said(caplog, why))


def _attempts(reporter: HttpReporter, at_least: int) -> bool:
    return reporter._pipeline.failures >= at_least


def test_reporter_logs_one_line_saying_why_it_was_refused(
    mtls: Exporter, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ampscope")
    cases = {
        "untrusted server certificate": dict(token=TOKEN, tls=ClientTls()),
        "requires a client certificate": dict(token=TOKEN, tls=ClientTls(ca_file=str(pki.ca.cert))),
        "wrong token": dict(
            token="nope",
            tls=ClientTls(
                ca_file=str(pki.ca.cert), cert_file=str(pki.client.cert),
                key_file=str(pki.client.key),
            ),
        ),
    }  # fmt: skip
    for why, kwargs in cases.items():
        caplog.clear()
        reporter = HttpReporter(mtls.url, retry_initial=0.05, retry_max=0.1, **kwargs)
        reporter.emit(record(1, run=f"refused-{why.split()[0]}"))
        # A TLS refusal is retried (the exporter's config may be fixed), a 401 is not: the
        # record is dropped. Either way the reason is said once, not at every retry: waited
        # for past the third failed attempt, however long each attempt takes.
        if why == "wrong token":
            wait_until(partial(_dropped_and_said, reporter, caplog, why), f"{why}: said")
        else:
            wait_until(partial(_attempts, reporter, 3), f"{why}: three attempts")
        assert len(_said(caplog, why)) == 1, (why, [r.getMessage() for r in caplog.records])
        reporter.close(0.5)
        assert reporter.sent == 0


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    import ampscope

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscope.GradScaler("cpu", init_scale=2.0**8, reporter="auto")
    for _ in range(5):
        scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    scaler.close()
    return {"steps": scaler.telemetry.snapshot().steps}


def test_ranks_report_through_token_ca_and_client_certificate(
    mtls: Exporter, pki: Pki, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        "AMPSCOPE_URL": mtls.url,
        "AMPSCOPE_TOKEN_FILE": str(token_file),
        "AMPSCOPE_CA_FILE": str(pki.ca.cert),
        "AMPSCOPE_CERT_FILE": str(pki.client.cert),
        "AMPSCOPE_KEY_FILE": str(pki.client.key),
        "AMPSCOPE_RUN_ID": "mtls-run",
    }
    results = run_distributed(_rank, world_size=2, env=env)
    assert [r["steps"] for r in results] == [5, 5]
    with _get(mtls.url + "/api/v1/runs/mtls-run/ranks", _context(pki)) as response:
        ranks = json.load(response)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    assert all(r["step"] == 5 for r in ranks), ranks


def _shown_scrape() -> dict[str, Any]:
    """The https scrape deploy/prometheus/prometheus.yml shows in comments, uncommented."""
    text = (Path(__file__).parents[3] / "deploy" / "prometheus" / "prometheus.yml").read_text()
    start = text.index("    # scheme: https")
    end = text.index("\n", text.index("password_file", start))
    block = "\n".join(line.removeprefix("    # ") for line in text[start:end].splitlines())
    shown: dict[str, Any] = yaml.safe_load(block)
    return shown


def test_real_prometheus_scrapes_over_tls_with_basic_auth(
    mtls: Exporter, pki: Pki, tmp_path: Path
) -> None:
    (tmp_path / "password").write_text(PASSWORD)
    scrape = _shown_scrape()
    assert scrape["scheme"] == "https"
    assert set(scrape["basic_auth"]) == {"username", "password_file"}
    scrape["tls_config"] |= {
        "ca_file": str(pki.ca.cert),
        # RequireAndVerifyClientCert: the certificate the example shows commented out.
        "cert_file": str(pki.client.cert),
        "key_file": str(pki.client.key),
    }
    scrape["basic_auth"]["password_file"] = str(tmp_path / "password")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "ampscope",
                **scrape,
                "static_configs": [{"targets": [f"127.0.0.1:{mtls.port}"]}],
            }
        ],
    }
    process, url = start_prometheus(config, tmp_path)
    try:

        def target() -> dict[str, Any] | None:
            with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=5) as response:
                active = json.load(response)["data"]["activeTargets"]
            return active[0] if active and active[0]["health"] != "unknown" else None

        wait_until(lambda: target() is not None, "a scrape")
        scraped = target()
        assert scraped is not None
        assert scraped["health"] == "up", scraped["lastError"]
    finally:
        stop_process(process)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"tls_server_config": {"cert_file": "x.crt", "key_file": "x.key",
                                "client_auth_type": "RequireAnyClientCert"}},
         "tls_server_config.client_auth_type"),
        ({"tls_server_config": {"cert_file": "absent.crt", "key_file": "absent.key"}},
         "tls_server_config.cert_file"),
        ({"basic_auth_users": {"alice": "secret"}}, "basic_auth_users.alice"),
        ({"http_server_config": {"http2": True}}, "http_server_config.http2"),
    ],
)  # fmt: skip
def test_an_invalid_file_exits_2_before_binding(
    tmp_path: Path, config: dict[str, Any], key: str
) -> None:
    path = tmp_path / "web.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "ampscope.cli", "serve", "--port", str(port),
         "--web-config-file", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ampscope serve: {path}: {key}: "), lines[0]
    assert "Uvicorn running" not in result.stderr + result.stdout


def test_the_environment_names_the_file_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ampscope.cli import main

    path = tmp_path / "web.yml"
    path.write_text("basic_auth_users: {alice: secret}\n")
    monkeypatch.setenv("AMPSCOPE_WEB_CONFIG_FILE", str(path))
    assert main(["serve", "--port", str(free_port())]) == 2
    assert f"ampscope serve: {path}: basic_auth_users.alice: " in capsys.readouterr().err


def _served_serial(url: str, ca: Path) -> int:
    """The serial number of the certificate a new connection is served."""
    context = ssl.create_default_context(cafile=str(ca))
    host, port = url.removeprefix("https://").split(":")
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    serial = subprocess.run(
        ["openssl", "x509", "-inform", "DER", "-noout", "-serial"],
        input=der, capture_output=True, check=True, timeout=30,
    ).stdout.decode().strip()  # fmt: skip
    return int(serial.split("=")[1], 16)


def _serial(cert: Path) -> int:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-serial"],
        capture_output=True, check=True, text=True, timeout=30,
    ).stdout  # fmt: skip
    return int(out.strip().split("=")[1], 16)


def test_rotation_without_restart(pki: Pki, tmp_path: Path) -> None:
    """A new certificate on file is served to new connections; a new user file takes
    effect on SIGHUP; a file that became invalid keeps the old configuration."""
    own = make_pki(tmp_path / "pki")
    config = _web_config(own, tmp_path)
    exporter = _start(tmp_path, config, own)
    try:
        first = _serial(own.server.cert)
        assert _served_serial(exporter.url, own.ca.cert) == first
        # Rotate the way cert-manager does: a new key pair signed by the same CA.
        (tmp_path / "next").mkdir()
        fresh = make_leaf(tmp_path / "next", "server", own.ca, "DNS:localhost,IP:127.0.0.1")
        own.server.key.write_bytes(fresh.key.read_bytes())
        own.server.cert.write_bytes(fresh.cert.read_bytes())
        second = _serial(own.server.cert)
        assert second != first
        wait_until(
            lambda: _served_serial(exporter.url, own.ca.cert) == second,
            "the new cert served",
        )

        config["basic_auth_users"] = {"grafana": bcrypt_hash("rotated")}
        exporter.config.write_text(yaml.safe_dump(config))
        exporter.process.send_signal(signal.SIGHUP)
        context = _context(own, cert=False)

        def new_user_only() -> bool:
            request = urllib.request.Request(exporter.url + "/api/v1/runs")
            request.add_header(
                "Authorization", "Basic " + base64.b64encode(b"grafana:rotated").decode()
            )
            try:
                return urllib.request.urlopen(request, timeout=5, context=context).status == 200
            except urllib.error.HTTPError:
                return False

        wait_until(new_user_only, "the rotated user accepted")
        assert exporter.process.poll() is None, "SIGHUP must not kill the exporter"

        exporter.config.write_text("basic_auth_users: {grafana: plain}\n")
        wait_until(lambda: "not reloaded" in exporter.log_text(), "the invalid reload logged")
        assert "basic_auth_users.grafana" in exporter.log_text()
        assert new_user_only(), "the previous configuration stays in force"
    finally:
        stop_process(exporter.process)


def test_a_certificate_without_an_allowed_san_is_cut(pki: Pki, tmp_path: Path) -> None:
    relative = os.path.relpath(pki.ca.cert, tmp_path)
    config = _web_config(
        pki,
        tmp_path,
        client_auth_type="RequireAndVerifyClientCert",
        client_ca_file=relative,
        client_allowed_sans=["rank.ampscope.test", "127.0.0.9"],
    )
    exporter = _start(tmp_path, config, pki)  # our client certificate carries the first SAN
    try:
        other = make_leaf(pki.directory, "intruder", pki.ca, "DNS:other.test", client=True)
        context = ClientTls(
            ca_file=str(pki.ca.cert), cert_file=str(other.cert), key_file=str(other.key)
        ).context()
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _get(exporter.url + "/healthz", context).read()
        metrics = _get(exporter.url + "/metrics", _context(pki)).read().decode()
        assert 'ampscope_exporter_ingest_rejections_total{reason="client_san"} 1.0' in metrics
        assert "match none of client_allowed_sans" in exporter.log_text()
    finally:
        stop_process(exporter.process)
