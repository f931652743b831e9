"""The chat page at `/`: three static files from the package (glmcore/server/static), no build step, and a
Content-Security-Policy that lets the page load nothing but them and talk to nothing but this server. The
page itself needs no key; its API calls send the one the user types (honouring --api-key)."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.exceptions import HTTPException

STATIC = Path(__file__).resolve().parent / "static"
FILES = {"chat.js": "text/javascript", "chat.css": "text/css"}     # the only files served (no path lookup)
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_chat_page(app: FastAPI) -> None:
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    @app.get("/index.html", include_in_schema=False)
    async def index():
        return RedirectResponse("/")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in FILES:
            raise HTTPException(404, "Not Found")
        return FileResponse(STATIC / name, media_type=f"{FILES[name]}; charset=utf-8", headers=HEADERS)
