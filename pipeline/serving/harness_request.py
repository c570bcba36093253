"""What the proxy reads from a harness's HTTP request, and how it refuses one.

The rollout token (``x-api-key`` or ``Authorization: Bearer``), the JSON body, the internal conversation in it;
a :class:`ProxyError` names what is wrong, and :func:`error_response` answers it in the endpoint's protocol with
``x-should-retry: false`` where retrying cannot help (every retry would be a dead leaf in the tree).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from pipeline.serving.http_server import Request, Response, json_response, request_credential
from pipeline.serving.wire import ErrorKind, Protocol
from pipeline.tokens.conversation import Conversation
from pipeline.tokens.from_wire import ConversionError, from_anthropic, from_chat, from_responses
from pipeline.tokens.toolparse import too_deep


class ProxyError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# Harnesses' requests nest about 20 levels (tool schemas); a deeper body is refused before any code walks it.
MAX_BODY_DEPTH = 128


def request_token(request: Request) -> str:
    return request_credential(request.headers)


def read_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object (the server drops bodies over ``max_bytes`` and marks the request)."""
    if request.too_large:
        raise ProxyError("too_large", f"request body over {max_bytes} bytes")
    raw = request.body
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # orjson refuses some JSON that clients do send and json accepts (lone surrogate escapes from truncated
        # tool output, integers over 64 bits); json also words the error for the client
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ProxyError("invalid_request", f"body is nested deeper than {MAX_BODY_DEPTH} levels") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ProxyError("invalid_request", f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ProxyError("invalid_request", f"body must be a JSON object, got {type(body).__name__}")
    if too_deep(body, MAX_BODY_DEPTH):
        raise ProxyError("invalid_request", f"body is nested deeper than {MAX_BODY_DEPTH} levels")
    return body


def convert(protocol: str, body: dict[str, Any]) -> Conversation:
    try:
        if protocol == "chat":
            return from_chat(body)
        if protocol == "anthropic":
            return from_anthropic(body)
        return from_responses(body)
    except ConversionError as e:
        raise ProxyError("invalid_request", str(e)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProxyError("invalid_request", f"malformed request: {type(e).__name__}: {e}") from None


def include_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options")
    return isinstance(so, dict) and bool(so.get("include_usage"))


def error_response(proto: Protocol, kind: ErrorKind, message: str) -> Response:
    status, body = proto.error(kind, message)
    headers = {"x-should-retry": "false"} if kind not in ("overloaded",) else {}
    return json_response(body, status=status, headers=headers)
