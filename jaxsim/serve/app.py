"""The HTTP face of a `SearchService`: JSON routes (/health, /search, /encode, /similarity),
request validation and the web page (docs/serve.md). Every error is a JSON object {"error":
message} (plus "field" when one field is at fault); no request value names a file.
"""
from __future__ import annotations

import contextlib
import importlib.resources
from typing import Any, Optional

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from jaxsim.search.vectors import text_problem
from jaxsim.serve.batcher import BatcherBusy, BatcherClosed
from jaxsim.serve.service import SearchService, ServeLimits


class FieldError(Exception):
    """One request field breaks a limit; answered 422 naming the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# Strict: "5" is not a top_k and 1 is not a string; unknown fields are refused by name.
_STRICT = ConfigDict(strict=True, extra="forbid")


class SearchRequest(BaseModel):
    model_config = _STRICT
    queries: list[str]
    top_k: int = 5
    threshold: Optional[float] = Field(default=0.6, allow_inf_nan=False)


class EncodeRequest(BaseModel):
    model_config = _STRICT
    sentences: list[str]
    normalize: bool = False


class SimilarityRequest(BaseModel):
    model_config = _STRICT
    queries: list[str]
    keys: list[str]


def _check_sentences(limits: ServeLimits, **fields: list[str]) -> None:
    """Each field non-empty, all of them together within max_sentences, each within max_chars,
    none blank or holding a lone surrogate (JSON "\\ud800" parses to one, and the tokenizer
    would then fail the whole merged batch, every other request in it included)."""
    for name, sentences in fields.items():
        if not sentences:
            raise FieldError(name, "must hold at least one sentence")
        for i, s in enumerate(sentences):
            if len(s) > limits.max_chars:
                raise FieldError(f"{name}[{i}]", f"{len(s)} characters, the limit is "
                                                 f"{limits.max_chars}")
            problem = text_problem(s, allow_blank=False)
            if problem is not None:
                raise FieldError(f"{name}[{i}]", problem)
    total = sum(len(s) for s in fields.values())
    if total > limits.max_sentences:
        raise FieldError(" + ".join(fields), f"{total} sentences, the limit is "
                                             f"{limits.max_sentences} per request")


class JsonResponse(Response):
    """A JSON answer written by orjson, returned by the routes themselves: FastAPI's default
    (jsonable_encoder, then json.dumps) costs several times more per search answer, and numpy
    arrays go out without a list copy. float64 arrays keep the digits `float` would print;
    NaN and inf become null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def _error(status: int, message: str, field: Optional[str] = None) -> JsonResponse:
    body = {"error": message} if field is None else {"error": message, "field": field}
    return JsonResponse(body, status_code=status)


def _validation_error(exc: RequestValidationError) -> JsonResponse:
    """FastAPI's list of pydantic errors as one message naming the first field at fault."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return _error(400, "body: not valid JSON", "body")
    field = ""  # e.g. queries[1], as _check_sentences names it
    for part in first.get("loc", ())[1:]:  # loc[0] is "body"
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    field = field or "body"
    why = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
    return _error(422, f"{field}: {why}", field)


class _BodyLimit:
    """ASGI middleware: refuses a request body over `max_bytes` (declared or streamed) with 413
    before the app sees it, so a huge upload costs neither memory nor parsing. The rest of the
    body is read and dropped (up to DRAIN_FACTOR times the limit) before answering: closing on
    unread data would reset the connection, and the client would never see the 413."""

    DRAIN_FACTOR = 16

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        over = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks, size, more = [], 0, True
        while more and size <= self.DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size <= self.max_bytes:  # past the limit, the rest is read and dropped
                chunks.append(message.get("body", b""))
        if over or size > self.max_bytes:
            refusal = _error(413, f"body: over the {self.max_bytes}-byte limit", "body")
            return await refusal(scope, receive, send)
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():  # the whole body once, then what the client sends next
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


def create_app(service: SearchService) -> FastAPI:
    """The FastAPI app serving `service`; starting the app starts the service's batcher and
    stopping it fails the requests still queued (clients get 503, never a hang)."""
    limits = service.limits
    page = (importlib.resources.files("jaxsim.serve") / "static" / "index.html").read_text(
        encoding="utf-8")  # read once: no route reads files

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        service.start()
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="jaxsim search", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_BodyLimit, max_bytes=limits.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        kind = request.headers.get("content-type", "")
        if "json" not in kind:  # FastAPI would only say the body is not an object
            return _error(415, f"body: send JSON with Content-Type: application/json (got "
                               f"{kind or 'none'})", "body")
        return _validation_error(exc)

    @app.exception_handler(FieldError)
    async def on_field(_request: Request, exc: FieldError):
        return _error(422, str(exc), exc.field)

    async def on_unavailable(_request: Request, exc: Exception):
        return _error(503, str(exc))

    app.add_exception_handler(BatcherBusy, on_unavailable)
    app.add_exception_handler(BatcherClosed, on_unavailable)

    @app.exception_handler(HTTPException)
    async def on_http(_request: Request, exc: HTTPException):
        if exc.status_code == 400:  # FastAPI could not decode the body; its cause says why
            why = ("nested too deeply" if isinstance(exc.__cause__, RecursionError)
                   else "JSON text must be UTF-8")
            return _error(400, f"body: not valid JSON ({why})", "body")
        return _error(exc.status_code, str(exc.detail))

    # Anything else is a server fault: the client gets JSON like every other answer, without
    # the traceback, which the server's log keeps.
    @app.exception_handler(Exception)
    async def on_fault(_request: Request, exc: Exception):
        return _error(500, f"internal error ({type(exc).__name__}); see the server log")

    @app.get("/", response_class=HTMLResponse)
    async def index_page():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        return JsonResponse({"status": "ok", **service.describe()})

    @app.post("/search")
    async def search(request: SearchRequest):
        _check_sentences(limits, queries=request.queries)
        if not 1 <= request.top_k <= limits.max_top_k:
            raise FieldError("top_k", f"must be in [1, {limits.max_top_k}], got {request.top_k}")
        results = await service.search(request.queries, request.top_k, request.threshold)
        return JsonResponse({"results": results})

    @app.post("/encode")
    async def encode(request: EncodeRequest):
        _check_sentences(limits, sentences=request.sentences)
        vectors = await service.encode(request.sentences, request.normalize)
        return JsonResponse({"dim": int(vectors.shape[1]), "vectors": vectors.astype(np.float64)})

    @app.post("/similarity")
    async def similarity(request: SimilarityRequest):
        _check_sentences(limits, queries=request.queries, keys=request.keys)
        scores = await service.similarity(request.queries, request.keys)
        return JsonResponse({"scores": scores.astype(np.float64)})  # NaN -> null

    return app
