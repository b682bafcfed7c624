"""The playground and docs routes over HTTP (the browser test, test_playground_browser.py, renders them)."""

from __future__ import annotations

import re

import pytest


@pytest.fixture
def client(serve):
    srv, _ = serve()
    with srv.client() as c:
        yield c


def _assets(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)


def test_playground_page_and_its_assets_are_served(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'id="played-samples"' in r.text
    assets = _assets(r.text)
    assert "static/playground.js" in assets and "static/playground.css" in assets
    for path in assets:
        if not path.startswith(("http", "docs", "redoc", "metrics")):
            assert client.get("/" + path).status_code == 200, path
    assert all(not a.startswith(("http:", "https:", "//")) for a in assets)  # no CDN


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(client, path):
    r = client.get(path)
    assert r.status_code == 200
    assets = [a for a in _assets(r.text) if a.startswith("/static/")]
    assert assets, r.text
    for a in assets:
        assert client.get(a).status_code == 200, a
    assert not re.search(r"https?://(?!127\.0\.0\.1)", re.sub(r"<!--.*?-->", "", r.text, flags=re.S)), r.text


def test_oauth2_redirect_and_schema_without_the_page_routes(client):
    assert client.get("/docs/oauth2-redirect").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert not {"/", "/docs", "/redoc", "/docs/oauth2-redirect"} & set(paths)
    assert client.get("/static/vendor/swagger-ui/LICENSE").status_code == 200
    assert client.get("/static/vendor/redoc/LICENSE").status_code == 200
