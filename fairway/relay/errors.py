"""Errors the relay raises; each maps to one answer the gateway gives (404, 409, 503...)."""

from __future__ import annotations


class RelayError(Exception):
    """Base class for everything the relay raises on purpose."""


class RelayUnavailable(RelayError):
    """The backing store (Redis) cannot be reached; callers answer 503 rather than hang."""


class ReplyNotFound(RelayError, KeyError):
    """No log for this reply: never created, or expired after its retention window (404)."""

    def __init__(self, reply_id: str) -> None:
        super().__init__(reply_id)
        self.reply_id = reply_id

    def __str__(self) -> str:
        return f"no token log for reply {self.reply_id!r} (unknown or expired)"


class LogReplaced(ReplyNotFound):
    """The reply's log is of a later run than the reader's: the log it asked for was lost and the
    reply runs again in a new log under the same id (ConversationService.restart). To that reader
    its log is gone, as ReplyNotFound says; it must not take the new run's events for its own."""

    def __init__(self, reply_id: str, run: int | None, held: int | None) -> None:
        super().__init__(reply_id)
        self.run = run
        self.held = held

    def __str__(self) -> str:
        return f"the token log of reply {self.reply_id!r} holds run {self.held}, not run {self.run}"


class RunReplaced(RelayError):
    """A producer's append (or finish) of run `run` to a log that holds run `held` (None: not
    said, run 0's): the reply's log was lost and the reply runs again in a new log, whose own
    producer writes it. A producer still running the old run (it never learnt its log was lost)
    stops there: its next n may well fit the new log, which would splice two texts into one."""

    def __init__(self, reply_id: str, run: int, held: int) -> None:
        super().__init__(f"reply {reply_id!r}: the token log holds run {held}, not this producer's run {run}")
        self.reply_id = reply_id
        self.run = run
        self.held = held


class ReplyFinished(RelayError):
    """An append or finish after the terminal event: the reply is over, nothing may follow it."""

    def __init__(self, reply_id: str, last_n: int) -> None:
        super().__init__(f"reply {reply_id!r} already finished at event {last_n}")
        self.reply_id = reply_id
        self.last_n = last_n


class EventOutOfOrder(RelayError):
    """An append whose n is not last+1: a duplicate or a gap (e.g. a zombie producer after failover)."""

    def __init__(self, reply_id: str, n: int, last_n: int) -> None:
        super().__init__(f"reply {reply_id!r}: event {n} does not follow event {last_n}")
        self.reply_id = reply_id
        self.n = n
        self.last_n = last_n


class EventIdOutOfRange(RelayError, ValueError):
    """A read/subscribe `after` beyond the end of a finished reply: no such event will ever exist."""

    def __init__(self, reply_id: str, after: int, last_n: int) -> None:
        super().__init__(f"reply {reply_id!r} ended at event {last_n}; there is nothing after {after}")
        self.reply_id = reply_id
        self.after = after
        self.last_n = last_n
