"""The built docs site: offline, internally consistent, and holding what the code defines."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

from ampscope.exporter.metrics.catalogue import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]

# Elements whose attribute the browser fetches while rendering the page. <a href> is only
# followed when clicked, so a link to another site is fine; <link rel=canonical> likewise.
FETCHED = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "input": ("src",),
    "image": ("href", "xlink:href"),
    "use": ("href", "xlink:href"),
}
NOT_FETCHED_LINK_RELS = {"canonical", "alternate", "author", "license", "next", "prev", "help"}
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)['"]""")


def is_external(url: str) -> bool:
    """A URL the browser would fetch from another host (``//host`` included)."""
    url = url.strip()
    return url.startswith("//") or urlsplit(url).scheme in {"http", "https", "ftp", "ws", "wss"}


def css_requests(css: str) -> list[str]:
    """Every ``url(...)`` and ``@import`` target in a stylesheet."""
    return [a or b for a, b in CSS_URL.findall(css)]


@dataclass
class _Page(HTMLParser):
    fetched: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    _in_style: bool = False

    def __post_init__(self) -> None:
        super().__init__(convert_charrefs=True)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if "id" in values:
            self.ids.add(values["id"])
        if "name" in values and tag == "a":
            self.ids.add(values["name"])
        for name in FETCHED.get(tag, ()):
            if name in values:
                # srcset: "url 1x, url 2x"
                self.fetched += [part.split()[0] for part in values[name].split(",") if part]
        if tag == "link" and "href" in values:
            rels = set(values.get("rel", "").lower().split())
            if not rels or not rels <= NOT_FETCHED_LINK_RELS:
                self.fetched.append(values["href"])
        if tag == "a" and "href" in values:
            self.links.append(values["href"])
        if "style" in values:
            self.fetched += css_requests(values["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.fetched += css_requests(data)


def parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def external_requests(site: Path) -> dict[str, list[str]]:
    """Per file of the site, every request its HTML or CSS would make to another host."""
    found: dict[str, list[str]] = {}
    for path in sorted(site.rglob("*")):
        if path.suffix == ".html":
            urls = parse(path).fetched
        elif path.suffix == ".css":
            urls = css_requests(path.read_text(encoding="utf-8"))
        else:
            continue
        external = [url for url in urls if is_external(url)]
        if external:
            found[str(path.relative_to(site))] = external
    return found


def _target(site: Path, page: Path, url: str) -> tuple[Path, str]:
    parts = urlsplit(url)
    base = page.parent if not parts.path.startswith("/") else site
    path = (base / unquote(parts.path.lstrip("/"))).resolve() if parts.path else page
    if path.is_dir():
        path = path / "index.html"
    return path, unquote(parts.fragment)


def test_no_page_requests_anything_from_another_host(built_site: Path) -> None:
    assert list(built_site.rglob("*.html")), "the build wrote no pages"
    assert external_requests(built_site) == {}


def test_the_check_finds_a_planted_cdn_reference(built_site: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(built_site, site)
    page = site / "metrics" / "index.html"
    html = page.read_text(encoding="utf-8")
    planted = (
        '<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/x/x.css">'
        '<script src="//unpkg.com/mermaid/dist/mermaid.min.js"></script>'
        "<style>@import url(https://fonts.googleapis.com/css?family=Roboto);</style>"
        '<img srcset="images/a.png 1x, https://example.org/b.png 2x">'
        '<a href="https://example.org/just-a-link">fine</a>'
    )
    page.write_text(html.replace("</head>", planted + "</head>", 1), encoding="utf-8")
    css = next(site.rglob("*.css"))
    css.write_text(css.read_text() + "@font-face{src:url('https://fonts.gstatic.com/f.woff2')}")
    found = external_requests(site)
    assert found.pop("metrics/index.html") == [
        "https://cdn.jsdelivr.net/npm/x/x.css",
        "//unpkg.com/mermaid/dist/mermaid.min.js",
        "https://fonts.googleapis.com/css?family=Roboto",
        "https://example.org/b.png",
    ]
    assert found == {str(css.relative_to(site)): ["https://fonts.gstatic.com/f.woff2"]}


def broken_links(site: Path) -> tuple[int, list[str]]:
    """How many internal links, images, scripts and styles the site's pages reference, and
    those whose file or anchor does not exist."""
    broken = []
    checked = 0
    pages = {path: parse(path) for path in site.rglob("*.html")}
    for path, page in pages.items():
        if path.name == "404.html":  # served at any depth, so its links are root-relative
            continue
        for url in page.links + page.fetched:
            if is_external(url) or urlsplit(url).scheme in {"mailto", "data", "javascript"}:
                continue
            target, fragment = _target(site, path, url)
            checked += 1
            if not target.is_file():
                broken.append(f"{path.relative_to(site)}: {url} (no such file)")
            elif fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else parse(target).ids
                if fragment not in ids:
                    broken.append(f"{path.relative_to(site)}: {url} (no such anchor)")
    return checked, broken


def test_every_internal_link_and_anchor_resolves(built_site: Path) -> None:
    checked, broken = broken_links(built_site)
    assert checked > 100
    assert broken == []


def test_the_link_check_finds_planted_broken_links(built_site: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    shutil.copytree(built_site, site)
    page = site / "metrics" / "index.html"
    planted = '<a href="../exporter/#no-such-anchor">a</a><img src="../images/missing.png">'
    page.write_text(page.read_text().replace("</article>", planted + "</article>", 1))
    assert broken_links(site)[1] == [
        "metrics/index.html: ../exporter/#no-such-anchor (no such anchor)",
        "metrics/index.html: ../images/missing.png (no such file)",
    ]


def test_every_page_is_in_the_nav() -> None:
    def pages(entries: list) -> set[str]:
        found = set()
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found |= pages(value) if isinstance(value, list) else {value}
        return found

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs").rglob("*.md")}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - on_disk == set(), "nav entries without a page"


def test_the_metric_reference_lists_every_catalogue_metric(built_site: Path) -> None:
    html = (built_site / "metrics" / "index.html").read_text(encoding="utf-8")
    rows = re.findall(r"<tr>\s*<td><code>(ampscope_\w+)</code></td>\s*<td>(\w+)</td>", html)
    assert dict(rows) == {spec.name: spec.type for spec in CATALOGUE}


def test_the_openapi_page_holds_the_app_factorys_document(built_site: Path) -> None:
    from ampscope.exporter.app import create_app
    from ampscope.exporter.settings import Settings

    schema = create_app(Settings()).openapi()
    html = (built_site / "openapi" / "index.html").read_text(encoding="utf-8")
    rows = set(re.findall(r"<td><code>([A-Z]+)</code></td>\s*<td><code>([^<]+)</code></td>", html))
    expected = {(m.upper(), path) for path, ops in schema["paths"].items() for m in ops}
    assert rows == expected
    # The whole document follows, as generated: every schema component is in it.
    for component in schema["components"]["schemas"]:
        assert f"&quot;{component}&quot;" in html or f'"{component}"' in html, component


def test_the_api_reference_renders_every_object_it_names(built_site: Path) -> None:
    names = re.findall(r"^::: (\S+)$", (ROOT / "docs" / "api.md").read_text(), re.M)
    page = parse(built_site / "api" / "index.html")
    assert names
    assert [name for name in names if name not in page.ids] == []
    html = (built_site / "api" / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)
    # Google-style sections become tables, not literal "Args:" text, and the docstrings'
    # Sphinx roles (:class:`~a.B`) become the names they refer to.
    assert "Args:" not in text
    assert re.findall(r":(?:class|meth|func|mod|attr):", text) == []
    assert "<code>TelemetryConfig</code>" in html


def test_search_works_offline(built_site: Path) -> None:
    index = (built_site / "search.json").read_text(encoding="utf-8")
    assert "found_inf_origin" in index
    assert "AmpscopeScaleDesync" in index
    # The index is searched in the browser by a worker shipped with the site.
    assert list((built_site / "assets" / "javascripts" / "workers").glob("search.*.js"))
    home = (built_site / "index.html").read_text(encoding="utf-8")
    assert 'data-md-component="search"' in home
