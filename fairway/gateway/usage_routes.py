"""GET /v1/usage: the caller's usage, totalled per model per day (UTC); and GET /metrics.

`from` and `to` are dates (YYYY-MM-DD) or Unix seconds, both days included; the default is the
last 30 days. Only the caller's own usage: asking for another user's (`user=`) is a 404, as for
anything else of theirs.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from fairway.gateway.app_state import gateway
from fairway.gateway.auth import authenticated, user_id
from fairway.gateway.errors import error_responses, invalid, not_found

router = APIRouter()

DEFAULT_DAYS = 30
MAX_DAYS = 366
FIRST_DAY, LAST_DAY = dt.date(2, 1, 1), dt.date(9998, 12, 31)  # the days a range may name


def _day(raw: str | None, param: str) -> dt.date | None:
    if raw is None or not raw.strip():
        return None
    raw = raw.strip()
    try:
        if raw.replace(".", "", 1).isdigit():
            day = dt.datetime.fromtimestamp(float(raw), dt.UTC).date()
        else:
            day = dt.date.fromisoformat(raw)
    except (ValueError, OverflowError, OSError):
        raise invalid(f"'{param}' must be a date (YYYY-MM-DD) or Unix seconds, got {raw!r}.", param,
                      "invalid_value") from None
    if not FIRST_DAY <= day <= LAST_DAY:  # room for the default range before it and the day after it
        raise invalid(f"'{param}' must be between {FIRST_DAY} and {LAST_DAY}, got {raw!r}.", param,
                      "invalid_value")
    return day


@router.get("/v1/usage", dependencies=[Depends(authenticated)], responses=error_responses(400, 401, 404, 503))
async def usage(
    request: Request,
    start: str | None = Query(None, alias="from"),
    end: str | None = Query(None, alias="to"),
    user: str | None = None,
) -> dict[str, Any]:
    me = user_id(request)
    if user is not None and user != me:
        raise not_found(f"No usage for user {user!r}.", "user", "user_not_found")
    last = _day(end, "to") or dt.datetime.now(dt.UTC).date()
    first = _day(start, "from") or last - dt.timedelta(days=DEFAULT_DAYS - 1)
    if first > last:
        raise invalid("'from' is after 'to'.", "from", "invalid_value")
    if (last - first).days >= MAX_DAYS:
        raise invalid(f"At most {MAX_DAYS} days at a time.", "from", "invalid_value")
    rows = await gateway(request).store.usage_totals(me, first.isoformat(), last.isoformat())
    data = [{"object": "usage.daily", "date": r["day"], "model": r["model"], "requests": r["requests"],
             "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
             "completion_tokens": r["completion_tokens"],
             "total_tokens": r["prompt_tokens"] + r["completion_tokens"], "cost": round(r["cost"], 8)}
            for r in rows]
    totals = {k: sum(d[k] for d in data) for k in ("requests", "prompt_tokens", "cached_tokens",
                                                    "completion_tokens", "total_tokens")}
    totals["cost"] = round(sum(d["cost"] for d in data), 8)
    # What the safety checks flagged in the period, per category (a refused message has no usage).
    since = dt.datetime.combine(first, dt.time(), dt.UTC).timestamp()
    until = dt.datetime.combine(last + dt.timedelta(days=1), dt.time(), dt.UTC).timestamp()
    flagged = await gateway(request).store.flagged_totals(me, since, until)
    return {"object": "list", "user": me, "from": first.isoformat(), "to": last.isoformat(), "data": data,
            "totals": totals, "flagged": flagged}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics() -> Response:
    """Prometheus text format. Open like /health: it says how busy the service is, nothing of
    anyone's data (block it at the proxy if that is too much)."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
