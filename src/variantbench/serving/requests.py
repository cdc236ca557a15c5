"""What a request may be: its body parsed with limits, its fields checked by pydantic models built
from this server's configuration, and the OpenAPI document those models describe.

Issue 41 found bodies that gave a 500 (nested 1,000 deep, a lone surrogate, ``1e308`` or ``NaN`` in a
number) and no bound on a body, a prompt (tokenized before its length was checked), ``stop`` or the
priority a client could pick. Each is now a 4xx with an OpenAI-style error body: the body's size is the ``Guard``'s
(``serving/guard.py``: 413 before the rest is read), ``parse_body`` refuses its shape (400 for
nesting, NaN/Infinity, invalid Unicode),
then the request's model refuses a field (400, naming it in ``param``). The models are built per
server (``RequestModels.for_limits``), so their JSON schema, served at ``/openapi.json``, states this
server's own bounds, and the fuzz suite (``tests/test_server_fuzz.py``) generates bodies from it.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

MAX_DEPTH = 32  # nesting of a request body (chat content parts are 4 deep)
MAX_DEADLINE_MS = 86_400_000.0  # a day: beyond it a deadline says nothing (1e308 overflowed the worker)
MAX_MODEL_NAME = 256
PROMPT_BYTES_PER_TOKEN = 32  # the default prompt limit per token of context: English runs ~4-5 bytes a token


class ApiError(Exception):
    """A refusal: an OpenAI-style error body (``{"error": {message, type, param, code}}``) and its status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def header_list(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return headers

    def response(self) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.header_list())


@dataclass(frozen=True)
class Limits:
    """The bounds a request must keep (the plan's ``serve`` section)."""

    max_len: int = 2048
    max_body_bytes: int = 4 << 20
    max_prompt_bytes: int | None = None  # None: PROMPT_BYTES_PER_TOKEN per token of max_len
    max_stop: int = 4
    max_stop_chars: int = 256
    max_messages: int = 1024
    priority_levels: int = 3

    @property
    def prompt_bytes(self) -> int:
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_len


# ---- the body ---------------------------------------------------------------------------------------


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body (its size bounded by the ``Guard`` already) as a JSON object, or a 400: not JSON
    (NaN and Infinity are not), nested too deeply, or holding a string that is not valid Unicode."""
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:  # UnicodeDecodeError too: the bytes are not UTF-8
        raise ApiError(400, f"the request body is not valid JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_tree(body, 0)
    return body


def _check_tree(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, "the request body holds a string that is not valid Unicode (a lone surrogate)"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tree(key, depth + 1)
            _check_tree(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_tree(item, depth + 1)


# ---- the fields -------------------------------------------------------------------------------------

_OPEN = ConfigDict(strict=True, extra="allow")  # strict: "1" is not 1, true is not 1; unknown fields pass
# a field whose type is a union: pydantic's message names one member; ours names them all
_SHAPES = {
    "prompt": "'prompt' must be a non-empty string, a list of one string, or a list of token ids",
    "stop": "'stop' must be a non-empty string or a list of them",
    "messages": "each message needs a 'role' and a 'content' (a string, or a list of text parts)",
    "tokens": "'tokens' must be a list of token ids",
}


class StreamOptions(BaseModel):
    model_config = _OPEN
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = _OPEN
    type: Literal["text"]
    text: str = ""


MAX_TOP_LOGPROBS = 20  # scoring's top log-probabilities per position (vLLM's cap; OpenAI's is 5)


class ScoreRequest(BaseModel):
    """Prompt scoring (``echo`` on ``/v1/completions``): the prompts' shapes are ``scoring.prompts_of``'s."""

    model_config = _OPEN
    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME)
    echo: Literal[True]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(None, ge=0, le=1, description="the prompt, and at most one next token")
    n: int = Field(1, ge=1, le=1)
    stream: Literal[False] = Field(False, description="scoring is not streamed")


@dataclass(frozen=True)
class RequestModels:
    """The request models of one server: completions, chat, tokenize, detokenize."""

    completion: type[BaseModel]
    chat: type[BaseModel]
    tokenize: type[BaseModel]
    detokenize: type[BaseModel]

    @staticmethod
    @functools.cache
    def for_limits(limits: Limits, names: tuple[str, ...] = ()) -> RequestModels:
        return _build(limits, names)


def _build(limits: Limits, names: tuple[str, ...]) -> RequestModels:
    n_chars = limits.prompt_bytes  # characters <= bytes: the byte count is checked on top
    model_field = Field(min_length=1, max_length=MAX_MODEL_NAME,
                        json_schema_extra={"enum": list(names)} if names else None)  # fmt: skip
    stop_text = Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars)]
    stop = stop_text | Annotated[list[stop_text], Field(min_length=1, max_length=limits.max_stop)]
    token = Annotated[int, Field(ge=0, lt=1 << 31)]
    common: dict[str, Any] = {
        "model": (str, model_field),
        "stream": (bool, False),
        "stream_options": (StreamOptions | None, None),
        "stop": (stop | None, None),
        "n": (int, Field(1, ge=1, le=1, description="one answer per request")),
        "temperature": (float | None, Field(None, ge=0, le=2, allow_inf_nan=False)),
        "top_p": (float | None, Field(None, ge=0, le=1, allow_inf_nan=False)),
        "frequency_penalty": (float | None, Field(None, ge=-2, le=2, allow_inf_nan=False)),
        "presence_penalty": (float | None, Field(None, ge=-2, le=2, allow_inf_nan=False)),
        "seed": (int | None, Field(None, ge=-(1 << 63), lt=1 << 63)),
        "priority": (
            int,
            Field(
                0,
                ge=0,
                lt=limits.priority_levels,
                description=f"0 (most urgent) to {limits.priority_levels - 1}",
            ),
        ),  # fmt: skip
        "deadline_ms": (float | None, Field(None, ge=1, le=MAX_DEADLINE_MS, allow_inf_nan=False)),
        "ignore_eos": (bool, False),
        "max_tokens": (int | None, Field(None, ge=1, le=limits.max_len)),
    }
    completion = create_model(
        "CompletionRequest", __config__=_OPEN,
        prompt=(Annotated[str, Field(min_length=1, max_length=n_chars)]
                | Annotated[list[Annotated[str, Field(min_length=1, max_length=n_chars)]], Field(min_length=1, max_length=1)]
                | Annotated[list[token], Field(min_length=1, max_length=limits.max_len)], ...),
        **common,
    )  # fmt: skip
    message = create_model(
        "ChatMessage", __config__=_OPEN,
        role=(str, Field(min_length=1, max_length=64)),
        content=(Annotated[str, Field(max_length=n_chars)] | Annotated[list[TextPart], Field(max_length=256)], ...),
    )  # fmt: skip
    chat = create_model(
        "ChatCompletionRequest", __config__=_OPEN,
        messages=(list[message], Field(min_length=1, max_length=limits.max_messages)),  # type: ignore[valid-type]
        max_completion_tokens=(int | None, Field(None, ge=1, le=limits.max_len)),
        **common,
    )  # fmt: skip
    tokenize = create_model(
        "TokenizeRequest", __config__=_OPEN,
        model=(str | None, Field(None, min_length=1, max_length=MAX_MODEL_NAME)),
        prompt=(Annotated[str, Field(max_length=n_chars)] | None, None),
        messages=(list[message] | None, Field(None, min_length=1, max_length=limits.max_messages)),  # type: ignore[valid-type]
        add_special_tokens=(bool, True),
    )  # fmt: skip
    detokenize = create_model(
        "DetokenizeRequest", __config__=_OPEN,
        model=(str | None, Field(None, min_length=1, max_length=MAX_MODEL_NAME)),
        tokens=(list[token], Field(..., max_length=limits.max_len)),
    )  # fmt: skip
    return RequestModels(completion, chat, tokenize, detokenize)


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """The body as ``model``, or a 400 naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None


def _field_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    field = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
    # a union field fails once per member: a bound it broke (too many stop strings) says more than
    # the members' types it does not have
    mine = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    bounds = [e for e in mine if e["type"] not in _SHAPE_ERRORS]  # the deepest: an item's, not its list's
    first = max(bounds, key=lambda e: len(e["loc"])) if bounds else (mine or errors)[0]
    if field in _SHAPES and first["type"] in _SHAPE_ERRORS:
        return ApiError(400, _SHAPES[field], field)
    loc = [p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPES))]
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    if first["type"] == "missing":
        return ApiError(400, f"'{where}' is required", field)
    got = json.dumps(first.get("input"), default=str)
    got = got if len(got) <= 40 else got[:37] + "..."
    msg = first["msg"][0].lower() + first["msg"][1:]
    # a prompt past the limit is the context's error, as the token count's would be
    longer = field in ("prompt", "messages") and first["type"] == "string_too_long"
    return ApiError(400, f"'{where}': {msg}, got {got}", field, "context_length_exceeded" if longer else None)


_SHAPE_ERRORS = {"string_type", "list_type", "int_type", "model_type", "literal_error", "dict_type",
                 "model_attributes_type", "union_tag_invalid"}  # fmt: skip
_TYPES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "constrained-str"}


# ---- the OpenAPI document ----------------------------------------------------------------------------


def openapi(models: RequestModels, title: str = "variantbench serve") -> dict[str, Any]:
    """An OpenAPI 3.1 document of the endpoints that take a body: the request schemas this server checks."""
    components: dict[str, Any] = {}

    def ref(model: type[BaseModel]) -> dict[str, str]:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    def post(model: type[BaseModel], summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": {"application/json": {"schema": ref(model)}}},
                         "responses": {"200": {"description": "the answer"},
                                       "400": {"description": "a field refused"}}}}  # fmt: skip

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}

    paths = {
        "/v1/completions": post(models.completion, "a completion (SSE when 'stream')"),
        "/v1/chat/completions": post(models.chat, "a chat completion (SSE when 'stream')"),
        "/tokenize": post(models.tokenize, "a prompt's token ids"),
        "/detokenize": post(models.detokenize, "token ids' text"),
        "/v1/models": get("the served models"),
        "/health": get("ok, or 503 while a worker is down"),
        "/metrics": get("Prometheus metrics"),
    }
    return {"openapi": "3.1.0", "info": {"title": title, "version": "1"}, "paths": paths,
            "components": {"schemas": components}}  # fmt: skip
