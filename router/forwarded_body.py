"""The fields the router sets on a tenant's request body (its engine `priority`, its cache salt,
its shared prefix, usage in the stream), written over whatever the client sent for them.

The body is forwarded as the bytes the client sent (re-serializing it costs more than routing
it): the fields are appended before the object's closing brace. JSON objects with a repeated name
keep the last value in Python's parser, which the engine uses (contract.openai.parse_request), so
the router's values win over any the client set: a tenant cannot raise its own priority or pick
another tenant's salt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def with_fields(body: bytes, fields: Mapping[str, Any]) -> bytes:
    """`body` (a JSON object, already parsed once by the router) with `fields` set last."""
    if not fields:
        return body
    end = body.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("the body is not a JSON object")
    head = end[:-1].rstrip()
    added = ",".join(
        f"{json.dumps(name)}:{json.dumps(value, separators=(',', ':'))}"
        for name, value in fields.items()
    ).encode("utf-8")
    separator = b"" if head.endswith(b"{") else b","
    return head + separator + added + b"}"
