"""An attack: tens of connections flood wrong passwords (bcrypt cost 10) while Prometheus
scrapes with the right one and a rank posts with its token. Every authorised request must
be answered; how fast is measured by ``python -m bench.auth_flood``, never asserted here."""

from __future__ import annotations

from pathlib import Path

from bench.auth_flood import exporter, flood, web_config

ATTACKERS = 40


def test_a_password_flood_leaves_scrapes_and_ingest_answering(tmp_path: Path) -> None:
    web_config(tmp_path)
    with exporter(tmp_path) as server:
        result = flood(server.port, attackers=0, requests=1)  # the right password, cached
        assert result.statuses == [200, 200]
        result = flood(server.port, attackers=ATTACKERS, requests=20)
        # Every attacker was refused once before the authorised requests began, and kept
        # a wrong password in flight throughout; each request has a 60 s socket timeout
        # (the generous deadlock guard).
        assert result.attackers_refused == ATTACKERS
        assert result.statuses == [200] * 40
