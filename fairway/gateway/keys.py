"""API keys: creating, checking and revoking the bearer keys users authenticate with.

A key is `sk-` plus URL-safe characters; new ones are `sk-fw-` + 32 random bytes (43 characters
of base64url). The store keeps only sha256(key): the key has 256 bits of entropy, so a fast hash
is as safe as a slow one and costs nothing per request. Each key belongs to one user and one tier
(paid, free, business, background), which pick the user's quotas and lane.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

from fairway.conversation import ApiKey, ConversationStore, DuplicateKey
from fairway.conversation.entities import new_id, now
from fairway.limits import Tier
from fairway.replica.registry import REGION

KEY_PREFIX = "sk-fw-"
KEY_PATTERN = re.compile(r"sk-[A-Za-z0-9_-]{8,200}")
TIERS = tuple(t.value for t in Tier)


class KeyFormatError(ValueError):
    pass


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_format(key: str) -> None:
    if not KEY_PATTERN.fullmatch(key):
        raise KeyFormatError("an API key is 'sk-' followed by 8 to 200 letters, digits, '-' or '_'")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def redact(key: str) -> str:
    """How a key shows in messages and lists: enough to recognise it, not to use it."""
    return key[:7] + "..." + key[-4:] if len(key) > 14 else key[:3] + "..."


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: use one of {', '.join(TIERS)}")
    return tier


def looks_like_key(text: str) -> bool:
    return text.startswith("sk-")


async def create_key(store: ConversationStore, user_id: str, tier: str, name: str = "",
                     key: str | None = None, region: str | None = None) -> tuple[ApiKey, str]:
    """A new key for the user (random unless `key` is given), served in `region` unless a
    request names another; returns the record and the key, which is shown this once and never
    stored."""
    check_tier(tier)
    if not user_id or len(user_id) > 128:
        raise ValueError("a user id is 1 to 128 characters")
    if region is not None and not REGION.fullmatch(region):
        raise ValueError("a region is 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    key = key or generate_key()
    check_format(key)
    record = ApiKey(new_id("key"), user_id, tier, hash_key(key), redact(key)[:16], name, now(), region=region)
    return await store.add_api_key(record), key


async def ensure_key(store: ConversationStore, key: str, user_id: str, tier: str, name: str = "") -> ApiKey:
    """The key's record, created for this user and tier if it is not stored yet (development keys,
    test keys). A stored key keeps its user, tier and revocation."""
    existing = await store.get_api_key(hash_key(key))
    if existing is not None:
        return existing
    try:
        return (await create_key(store, user_id, tier, name, key))[0]
    except DuplicateKey:  # another process stored it at the same moment
        stored = await store.get_api_key(hash_key(key))
        assert stored is not None
        return stored


async def revoke(store: ConversationStore, key_or_id: str) -> ApiKey | None:
    """Revoke by the key itself or by its id (key_...)."""
    return await store.revoke_api_key(hash_key(key_or_id) if looks_like_key(key_or_id) else key_or_id)


@dataclass(frozen=True)
class Principal:
    """Who a request is from, once its key checked out."""

    user_id: str
    tier: str
    key_id: str
    region: str | None = None  # the key's region setting: requests that name none are served there


class InvalidKey(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class KeyChecker:
    """Bearer key -> Principal. Valid keys are cached for cache_s seconds, so a busy user costs one
    database read per cache_s, not one per request; a revocation takes effect within cache_s.
    Unknown keys are not cached (the format check already turns away garbage)."""

    def __init__(self, store: ConversationStore, cache_s: float = 5.0, max_cached: int = 100_000) -> None:
        self.store = store
        self.cache_s = cache_s
        self.max_cached = max_cached
        self._cache: dict[str, tuple[float, Principal]] = {}

    async def check(self, key: str) -> Principal:
        try:
            check_format(key)
        except KeyFormatError as exc:
            raise InvalidKey(f"Incorrect API key format: {exc}.") from None
        digest = hash_key(key)
        clock = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > clock:
            return cached[1]
        record = await self.store.get_api_key(digest)
        if record is None or record.revoked:
            self._cache.pop(digest, None)
            why = "has been revoked" if record is not None else "is not valid"
            raise InvalidKey(f"Incorrect API key provided: {redact(key)} {why}.")
        principal = Principal(record.user_id, record.tier, record.id, record.region)
        if len(self._cache) >= self.max_cached:
            self._cache.clear()  # crude, bounded; the next requests refill it
        self._cache[digest] = (clock + self.cache_s, principal)
        return principal

    def forget(self) -> None:
        self._cache.clear()
