"""The ASGI app of `glmcore serve`: routes (OpenAI's chat and completions, the Responses and Messages APIs, the
tokenizer endpoints, /health, /metrics, the chat page), the API key, the Host check and the one place an
exception becomes an error body. The exchanges themselves are glmcore.server.exchange's."""
from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import GlmcoreError
from .anthropic import ANTHROPIC_PREFIX, add_anthropic_routes, anthropic_error
from .exchange import (ENDPOINTS, MAX_BODY, READ_TIMEOUT, ROUTES, Exchange, State, read_body,
                       serve_exchange)
from .inputs import check_model
from .page import add_chat_page
from .protocol import ApiError, error_body
from .responses import add_responses_routes
from .tokenize import detokenize, tokenize, tokenizer_info

log = logging.getLogger("glmcore.server")


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


class HostCheck:
    """Answers a request whose Host header names none of `allowed` with a 421 (any host with "*"). A page on
    another site that rebinds its own name to this server's address (DNS rebinding) sends its own name, so
    it cannot read a reply: by default only the listening address and localhost are served."""

    def __init__(self, app, allowed):
        self.app, self.allowed = app, {h.lower().rstrip(".") for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "*" not in self.allowed:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = (host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]).lower().rstrip(".")
            if name not in self.allowed and not name.endswith(".localhost"):
                shown = ", ".join(sorted(self.allowed))
                response = JSONResponse(error_body(
                    f"this server does not answer to the host {host[:60]!r} (it answers to {shown}); start it "
                    "with --allowed-hosts NAME to add a name", code="misdirected_request"), status_code=421)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(model, name: str, api_key: str | None = None, max_body: int = MAX_BODY,
               retry_after: int = 1, read_timeout: float = READ_TIMEOUT, allowed_hosts=LOCAL_HOSTS,
               cors_origins=(), thinking_budget: int | None = None) -> FastAPI:
    """The ASGI app over a LoadedModel with a scheduler (load_model(..., slots=N)); the caller starts the
    scheduler's thread (scheduler.start()) and stops it. allowed_hosts: the names the Host header may give
    ("*": any); cors_origins: the web origins whose pages may call the API (none by default); thinking_budget: the
    most tokens a thinking model's thought may take where a request names no budget (None: no limit)."""
    if model.scheduler is None:
        raise GlmcoreError("the server needs a model loaded with slots (load_model(..., slots=N))")
    if api_key is not None and not api_key.strip():
        raise GlmcoreError("the API key is empty (was --api-key given an unset variable?); give a key, or leave "
                           "the option out to serve without one")
    if thinking_budget is not None and thinking_budget < 0:
        raise GlmcoreError(f"invalid thinking budget {thinking_budget}: use 0 or more tokens (or none: no limit)")
    state = State(model, name, api_key, max_body, retry_after, read_timeout, thinking_budget)
    app = FastAPI(title="glmcore", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.glmcore = state
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
                           max_age=600)
    app.add_middleware(HostCheck, allowed=list(allowed_hosts))      # added last: runs first

    async def error(request, e: Exception):
        """The one place an exception becomes OpenAI's error JSON (Anthropic's on the Messages API's routes)."""
        shape = anthropic_error if request.url.path.startswith(ANTHROPIC_PREFIX) else lambda status, body: body
        if isinstance(e, ApiError):
            return JSONResponse(shape(e.status, e.body()), status_code=e.status, headers=e.headers)
        if isinstance(e, StarletteHTTPException):
            msg = f"{request.method} {request.url.path}: {e.detail}"
            return JSONResponse(shape(e.status_code, error_body(msg, code="not_found" if e.status_code == 404
                                                                else None)),
                                status_code=e.status_code, headers=e.headers)
        log.exception("internal error")     # never a traceback to the client; the log has it
        state.metrics.requests.labels(ENDPOINTS.get(request.url.path, "other"), "500").inc()
        return JSONResponse(shape(500, error_body(f"internal error ({type(e).__name__}); see the server log",
                                                  "server_error")), status_code=500)
    for kind in (ApiError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, error)

    async def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:          # Anthropic's header, honoured on every route like the bearer key
            scheme, token = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' (or "
                           "'x-api-key: KEY')", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @v1.get("/models/{model_id:path}")
    async def model_card(model_id: str):
        check_model(state, model_id)
        return _model_card(state)

    def route(kind: type[Exchange]):
        async def endpoint(request: Request):
            return await serve_exchange(state, request, kind)
        return endpoint
    for path, kind in ROUTES.items():
        v1.add_api_route(path, route(kind), methods=["POST"])
    add_responses_routes(v1, state, route)
    add_anthropic_routes(v1, state, route)
    app.include_router(v1)
    add_chat_page(app)
    tokenizer = APIRouter(dependencies=[Depends(authorize)])     # at the root, as vLLM serves them

    @tokenizer.post("/tokenize")
    async def tokenize_route(request: Request):
        return await state.prepare(tokenize, state, await read_body(request, state.max_body, state.read_timeout))

    @tokenizer.post("/detokenize")
    async def detokenize_route(request: Request):
        return await state.prepare(detokenize, state, await read_body(request, state.max_body, state.read_timeout))

    @tokenizer.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(state)
    app.include_router(tokenizer)

    @app.api_route("/health", methods=["GET", "HEAD"])      # HEAD: what uptime monitors send
    async def health():
        s = state.scheduler
        return {"status": "ok", "model": state.name, "slots": s.batch.n_slots, "busy_slots": s.busy_slots,
                "queue_length": s.queue_len}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _model_card(state: State) -> dict:
    m = state.model
    return {"id": state.name, "object": "model", "created": state.created, "owned_by": "glmcore",
            "family": m.config.family, "backend": m.backend.name, "context": state.scheduler.capacity}
