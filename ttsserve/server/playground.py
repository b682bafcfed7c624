"""The web playground at `/` and the API docs at `/docs` and `/redoc`, all from files shipped in the package.

The playground is plain HTML, JS and CSS (server/static/): no build step, no CDN. Swagger UI and Redoc are
vendored under server/static/vendor/ (their licences beside them), so the docs render on a machine without
network access. The app is created with docs_url=None and redoc_url=None; these routes replace FastAPI's,
which point the browser at a CDN.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
STATIC_URL = "/static"
_VENDOR = f"{STATIC_URL}/vendor"
# The page's scripts are same-origin; Swagger's own validator would call validator.swagger.io.
_SWAGGER_PARAMS = {"validatorUrl": None, "deepLinking": True, "persistAuthorization": True}


def register_playground(app: FastAPI) -> None:
    """GET / (the playground), /static/*, /docs, /docs/oauth2-redirect and /redoc, outside the OpenAPI schema."""
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{_VENDOR}/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{_VENDOR}/swagger-ui/swagger-ui.css",
            swagger_favicon_url=f"{root}{_VENDOR}/swagger-ui/favicon-32x32.png",
            oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
            swagger_ui_parameters=_SWAGGER_PARAMS,
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"),
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{_VENDOR}/redoc/redoc.standalone.js",
            redoc_favicon_url=f"{root}{_VENDOR}/swagger-ui/favicon-32x32.png",
            with_google_fonts=False,
        )
