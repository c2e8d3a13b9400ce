"""Who is asking. Until the edge issue brings real keys (with tiers and quotas), any bearer key
is accepted and names its user: conversations are private to the key that made them."""

from __future__ import annotations

import hashlib

from fastapi import Request

ANONYMOUS = "anonymous"


def user_id(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return ANONYMOUS
    # A hash, so the store never holds the key itself.
    return "key_" + hashlib.sha256(key.strip().encode()).hexdigest()[:24]
