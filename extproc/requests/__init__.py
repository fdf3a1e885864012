"""PLACEHOLDER until request parsing lands: model extraction only."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import orjson

from extproc.core import Api, InferenceRequest
from extproc.errors import BadRequest

_APIS = {
    "/v1/completions": Api.COMPLETIONS,
    "/v1/chat/completions": Api.CHAT,
    "/v1/responses": Api.RESPONSES,
    "/v1/embeddings": Api.EMBEDDINGS,
    "/v1/messages": Api.MESSAGES,
}


class ParseSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


def parse_request(
    path: str, headers: Mapping[str, str], body: bytes, settings: ParseSettings
) -> InferenceRequest:
    api = _APIS.get(path.split("?", 1)[0], Api.UNKNOWN)
    rid = headers.get("x-request-id", "")
    if api is Api.UNKNOWN:
        return InferenceRequest(request_id=rid, path=path, headers=headers, body_bytes=len(body))
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
        raise BadRequest("'model' is required and must be a string")
    return InferenceRequest(
        request_id=rid, path=path, api=api, model=doc["model"], headers=headers,
        body_bytes=len(body),
    )
