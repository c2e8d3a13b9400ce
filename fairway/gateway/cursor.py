"""A client's event id (Last-Event-ID) across the runs of a reply.

A reply whose token log was lost (its process restarted with the in-process relay, a Redis that
lost it) runs again from its stored context, in a new log numbered from 1 (Reply.restarts counts
the runs). Its events go out as restarts * RUN_SPAN + n, so an id a client holds from an earlier
run is told apart from one of the new log: that client is sent the new run from its start, after a
snapshot that empties the text it had, instead of the new run's events past its old id spliced onto
its old text. A reply never restarted keeps the log's own numbers. Each log knows its run
(TokenLog.create(run=)), so a gateway that read restarts = k reads run k's log or is told it is
gone (LogReplaced), never the next run's log numbered as run k's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairway.relay.token_log import RUN_SPAN  # (the Redis log publishes a later run's events so too)

__all__ = ["RUN_SPAN", "Cursor", "wire_id"]


@dataclass(frozen=True)
class Cursor:
    """Where a client is in a reply: which run its id came from, and the event n in that run's log."""

    run: int
    n: int

    @classmethod
    def of(cls, event_id: int) -> Cursor:
        run, n = divmod(event_id, RUN_SPAN)
        return cls(run, n)


def wire_id(run: int, n: int) -> int:
    """The id a client sees for event n of the reply's run `run` (0 for its first run)."""
    return run * RUN_SPAN + n
