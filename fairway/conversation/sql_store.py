"""The conversation store on SQLAlchemy 2 (asyncio): one set of queries for SQLite (aiosqlite,
the embedded default) and PostgreSQL (asyncpg, at scale). The schema comes from the Alembic
migrations next to this file, on both. On PostgreSQL the chat path's single statements, still
built here, skip the engine and run on asyncpg's own pool (hot_path.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

import asyncpg
import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fairway.domain import STATE_OF_STATUS

from .connect_params import engine_args
from .entities import (
    ApiKey,
    Attachment,
    Conversation,
    Message,
    MessageStatus,
    Reply,
    ReplyState,
    Role,
    UsageRecord,
    new_id,
    now,
)
from .hot_path import PostgresHotPath
from .schema import api_keys, conversations, messages, replies, usage_records
from .store import (
    REPLY_UPDATABLE,
    ConversationBusy,
    ConversationStore,
    DuplicateClientKey,
    DuplicateKey,
    Ending,
    InvalidText,
    NewTurn,
    NotFound,
    ReplyFinished,
    StoreError,
    StoreUnavailable,
)

MIGRATIONS = Path(__file__).parent / "migrations"
# Any fixed number: PostgreSQL advisory locks are keyed by a bigint.
_MIGRATION_LOCK_KEY = 0x0FA1_4A7C


def alembic_config() -> Config:
    """Alembic configured in code, so no alembic.ini has to sit in the working directory."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


_MIGRATION_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary())


def _migration_lock() -> asyncio.Lock:
    loop = asyncio.get_running_loop()
    return _MIGRATION_LOCKS.setdefault(loop, asyncio.Lock())


async def migrate(engine: AsyncEngine) -> None:
    """The database to the migrations' head: the conversation store's tables and those that live
    beside them (memory's, files', the vector index's). Safe to call again, and from many
    processes at once."""
    # Alembic keeps the running migration in a module-global context, so two upgrades in one
    # process must not interleave (the database lock below only orders separate processes).
    async with _migration_lock(), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Replicas and gateways start together: one migrates, the others wait and then find
            # the schema at head.
            await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK_KEY)))
        await conn.run_sync(_upgrade_to_head)


def _upgrade_to_head(connection: Connection) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection  # env.py migrates on it instead of connecting
    command.upgrade(cfg, "head")


def _engine_options(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # A gateway runs hundreds of requests at once, each checking out a connection several
        # times. SQLAlchemy's default pool keeps 5 and closes up to 10 more on return, so bursts
        # keep opening PostgreSQL connections; 20 stay open here. Liveness is checked at checkout
        # (_replace_closed).
        return {"pool_size": 20, "max_overflow": 20}
    if parsed.database in (None, "", ":memory:"):
        # Each connection to :memory: is its own empty database: share one connection.
        return {"poolclass": StaticPool}
    # Each aiosqlite connection is a thread of its own: overflow connections, closed on return,
    # would start a thread (and open the file, and run the PRAGMAs) per checkout in a burst.
    return {"pool_size": 20, "max_overflow": 20}


def _replace_closed(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """At checkout, a pooled connection the server closed (a PostgreSQL restart, an idle timeout)
    is swapped for a new one, so the request using it does not fail. asyncpg notices the closed
    socket by itself, so this costs no round trip, where pool_pre_ping spends three (BEGIN, a
    query, ROLLBACK) on every checkout, a dozen checkouts per chat request."""
    driver = getattr(dbapi_connection, "driver_connection", None)
    if driver is not None and driver.is_closed():
        raise sa.exc.DisconnectionError("the server closed this pooled connection")


_SQLITE_WRITE_LOCKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary())


def _sqlite_write_lock(url: str) -> asyncio.Lock:
    """This process's writers to one SQLite file, queued in order.

    SQLite has one writer at a time; the others wait in its busy handler, which sleeps and
    retries (1, 2, 5 ... up to 100 ms between tries). Sixteen chats starting at once each waited
    for the others' sleeps, the last one's turn longest. Queued here, each write starts as soon as
    the one before commits. (Other processes on the file still meet the busy handler: rare, e.g.
    `fairway keys create` next to a running server.)"""
    locks = _SQLITE_WRITE_LOCKS.setdefault(asyncio.get_running_loop(), {})
    return locks.setdefault(url, asyncio.Lock())


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")  # off by default in SQLite
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cursor.execute("PRAGMA busy_timeout=30000")  # wait for the writer instead of failing
    cursor.close()


# What asyncpg raises when the server is away: refused or lost sockets, a shutdown or restart in
# progress (57...), no connection slots left (53...).
_UNREACHABLE = (OSError, asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError,
                asyncpg.InsufficientResourcesError)


def _unreachable(exc: BaseException) -> bool:
    """Whether exc says the database cannot be reached, as asyncpg raises it or as SQLAlchemy
    wraps it (a disconnect it detected, or the asyncpg error behind its adapter's)."""
    if isinstance(exc, sa.exc.DBAPIError):
        behind = (exc.orig.__cause__ or exc.orig) if exc.orig is not None else None
        return exc.connection_invalidated or (behind is not None and _unreachable(behind))
    return isinstance(exc, _UNREACHABLE)


# PostgreSQL's SQLSTATEs for text it cannot hold: 22021 character_not_in_repertoire (a NUL, which
# no text value may contain) and 22P05 untranslatable_character (one the server's encoding lacks).
_TEXT_REFUSED = frozenset({"22021", "22P05"})


def refused_text(exc: BaseException) -> bool:
    """Whether exc is PostgreSQL refusing a text value, as asyncpg raises it or as SQLAlchemy wraps
    it (its adapter's error carries the SQLSTATE too)."""
    if isinstance(exc, sa.exc.DBAPIError):
        return exc.orig is not None and refused_text(exc.orig)
    return getattr(exc, "sqlstate", None) in _TEXT_REFUSED


def _as_store_error(exc: BaseException) -> StoreError | None:
    """The store's error for a database error that is not the store's fault: text PostgreSQL
    refuses (InvalidText, a 400: the input's fault), an unreachable database (StoreUnavailable, a
    503: retry); None for any other."""
    if refused_text(exc):
        return InvalidText(f"the database refused this text: {exc}")
    if _unreachable(exc):
        return StoreUnavailable(f"the database is unavailable: {exc}")
    return None


@contextlib.contextmanager
def reaching_database() -> Iterator[None]:
    """Database errors that are not the store's fault as the store's errors (_as_store_error);
    everything else as it is. Every store's calls on asyncpg's pool run inside it."""
    try:
        yield
    except Exception as exc:
        error = _as_store_error(exc)
        if error is not None:
            raise error from exc
        raise


def store_errors_on_engine(engine: AsyncEngine) -> None:
    """Every statement (and connection) of this engine raises the store's errors as
    reaching_database() would: for the stores that run theirs on the engine directly, in many
    places (memory's, files', the vector index's), one hook instead of a wrapper each."""

    def handle_error(context: Any) -> None:
        error = _as_store_error(context.original_exception)
        if error is None and context.is_disconnect:
            error = StoreUnavailable(f"the database is unavailable: {context.original_exception}")
        if error is not None:
            raise error

    sa.event.listen(engine.sync_engine, "handle_error", handle_error)


def _values(entity: object) -> dict[str, Any]:
    """A dataclass as column values; enums as their plain strings (asyncpg wants str), a message's
    attachments as JSON objects."""
    return {k: _column_value(v) for k, v in vars(entity).items()}


def _column_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list) and value and isinstance(value[0], Attachment):
        return [asdict(a) for a in value]
    return value


def _conversation(row: Mapping[str, Any]) -> Conversation:
    return Conversation(**row)


def _message(row: Mapping[str, Any]) -> Message:
    attached = row["attachments"]
    return Message(**{**row, "role": Role(row["role"]), "status": MessageStatus(row["status"]),
                      "attachments": [_attachment(a) for a in attached] if attached else None})


def _attachment(stored: Mapping[str, Any]) -> Attachment:
    # By name: a key a later version adds to the stored object is not this version's field.
    return Attachment(stored["file_id"], stored["filename"], stored["bytes"], stored["content_type"])


def _reply(row: Mapping[str, Any]) -> Reply:
    return Reply(**{**row, "state": ReplyState(row["state"])})


# The statements of every chat request, built once and executed with their values as parameters:
# building one per call (insert(...).values(row) and its cache key) costs SQLAlchemy more than
# running it (bench/README.md, store_requests.py); a prebuilt statement's cache key is memoized.
_INSERT = {table.name: sa.insert(table) for table in (conversations, messages, replies, api_keys)}
_TOUCH = (sa.update(conversations).where(conversations.c.id == sa.bindparam("b_id"))
          .values(updated_at=sa.bindparam("b_ts")))
_REPLY_BY_ID = sa.select(replies).where(replies.c.id == sa.bindparam("b_id"))
_CLAIM_RESTART = (sa.update(replies)
                  .where(replies.c.id == sa.bindparam("b_id"), replies.c.finished_at.is_(None),
                         replies.c.restarts == sa.bindparam("b_restarts"))
                  .values(restarts=replies.c.restarts + 1, replica_id=sa.bindparam("b_replica"))
                  .returning(*replies.c))
_FINISH_REASON_OF_REPLY = sa.select(replies.c.id, replies.c.finish_reason).where(replies.c.id == sa.bindparam("b_id"))
_UNFINISHED_BEFORE = (sa.select(replies.c.id)
                      .where(replies.c.finished_at.is_(None), replies.c.created_at < sa.bindparam("b_before"))
                      .order_by(replies.c.created_at))
_JOB_OF_REPLY = sa.select(replies.c.id, replies.c.job).where(replies.c.id == sa.bindparam("b_id"))
_PLACED = frozenset({"state", "replica_id"})  # where a reply runs or waits
# A Conversation's columns: active_reply_id is the store's claim, not part of the entity.
_CONVERSATION_COLUMNS = [c for c in conversations.c if c.name != "active_reply_id"]
# A conversation may take a new reply: it has none yet, or its newest has ended. On PostgreSQL a
# turn racing another waits for the other's claim to commit and then re-reads the row, whose new
# active_reply_id names a reply this statement's snapshot cannot see: not ended, so not claimed.
_FREE = sa.or_(conversations.c.active_reply_id.is_(None),
               sa.exists().where(replies.c.id == conversations.c.active_reply_id, replies.c.finished_at.is_not(None)))
_CLAIM = (sa.update(conversations).where(conversations.c.id == sa.bindparam("b_id"), _FREE)
          .values(updated_at=sa.bindparam("b_ts"), active_reply_id=sa.bindparam("b_reply")))
_ACTIVE_REPLY = sa.select(conversations.c.active_reply_id).where(conversations.c.id == sa.bindparam("b_id"))
_CONVERSATION_OF_USER = sa.select(*_CONVERSATION_COLUMNS).where(conversations.c.id == sa.bindparam("b_id"),
                                                       conversations.c.user_id == sa.bindparam("b_user"))
_MESSAGES_OF = (sa.select(messages).where(messages.c.conversation_id == sa.bindparam("b_conversation"))
                .order_by(messages.c.created_at, messages.c.id))
_MESSAGE_BY_CLIENT_KEY = sa.select(messages).where(messages.c.conversation_id == sa.bindparam("b_conversation"),
                                                   messages.c.client_key == sa.bindparam("b_key"))
_MESSAGE_OF_REPLY = (  # with the reply's state: a reply finished without a message (shed) says so
    sa.select(replies.c.state.label("reply_state"), messages)
    .select_from(replies.outerjoin(messages, sa.and_(messages.c.conversation_id == replies.c.conversation_id,
                                                     messages.c.reply_id == replies.c.id)))
    .where(replies.c.id == sa.bindparam("b_id"))
)


@functools.cache
def _update_reply_statement(columns: frozenset[str], whole_row: bool = True) -> sa.Update:
    """UPDATE of these reply columns (bound as b_<column>) unless it is finished, returning the row
    (or, without whole_row, its conversation id only). finished_at IS NULL in the WHERE makes
    "final states are final" atomic: of two racing writers only the first one to commit a final
    state changes the row."""
    return (
        sa.update(replies)
        .where(replies.c.id == sa.bindparam("b_id"), replies.c.finished_at.is_(None))
        .values(**{column: sa.bindparam(f"b_{column}") for column in sorted(columns)})
        .returning(*(replies.c if whole_row else [replies.c.conversation_id]))
    )


def _row_of(conversation_id: sa.ColumnElement[Any], table: sa.Table, prefix: str) -> sa.Select:
    """SELECT conversation_id (a CTE's column) as the row's, and a bind parameter
    <prefix><column> for every other column, FROM that CTE: the row exists only if the CTE's does."""
    return sa.select(*[conversation_id if column.name == "conversation_id"
                       else sa.bindparam(f"{prefix}{column.name}", type_=column.type) for column in table.c])


@functools.cache
def _finish_statement(columns: frozenset[str]) -> sa.Select:
    """PostgreSQL: finish_reply's three writes as one statement (data-modifying CTEs): mark the
    reply final unless it is (bound as b_<column>), insert its message (m_<column>) only if that
    happened, bump the conversation; returns the conversation id, or no row if the reply was final
    already or is unknown. One round trip on an autocommit connection instead of five (BEGIN, the
    three statements, COMMIT), and run by both savers of every reply."""
    finished = _update_reply_statement(columns, whole_row=False).cte("finished")
    answer = (sa.insert(messages)
              .from_select([c.name for c in messages.c], _row_of(finished.c.conversation_id, messages, "m_"))
              .returning(messages.c.conversation_id).cte("answer"))
    touched = (sa.update(conversations).where(conversations.c.id == answer.c.conversation_id)
               .values(updated_at=sa.bindparam("m_created_at")).cte("touched"))
    return sa.select(answer.c.conversation_id).add_cte(touched)


@functools.cache
def _turn_statement(new_conversation: bool, num_messages: int, with_reply: bool = True) -> sa.Select:
    """PostgreSQL: store_turn's writes as one statement (data-modifying CTEs). The anchor inserts
    the conversation (c_<column>) or bumps an existing one (t_id, t_ts); the messages (m<i>_<column>)
    and the reply (r_<column>) are inserted FROM it, so a conversation gone meanwhile, or one still
    answering (_FREE; a turn with a reply claims it), gets nothing (and the statement returns no
    row). One round trip instead of five."""
    if new_conversation:
        anchor = (sa.insert(conversations).values({c.name: sa.bindparam(f"c_{c.name}", type_=c.type)
                                                   for c in conversations.c})
                  .returning(conversations.c.id).cte("conversation"))
    elif with_reply:
        anchor = (sa.update(conversations).where(conversations.c.id == sa.bindparam("t_id"), _FREE)
                  .values(updated_at=sa.bindparam("t_ts"), active_reply_id=sa.bindparam("r_id"))
                  .returning(conversations.c.id).cte("conversation"))
    else:
        anchor = (sa.update(conversations).where(conversations.c.id == sa.bindparam("t_id"))
                  .values(updated_at=sa.bindparam("t_ts")).returning(conversations.c.id).cte("conversation"))
    rows = [_row_of(anchor.c.id, messages, f"m{i}_") for i in range(num_messages)]
    stored = (sa.insert(messages).from_select([c.name for c in messages.c], rows[0] if len(rows) == 1
                                              else sa.union_all(*rows))
              .returning(messages.c.id).cte("stored"))
    if not with_reply:
        return sa.select(anchor.c.id).add_cte(stored)
    queued = (sa.insert(replies).from_select([c.name for c in replies.c], _row_of(anchor.c.id, replies, "r_"))
              .returning(replies.c.id).cte("queued"))
    return sa.select(anchor.c.id).add_cte(stored, queued)


def _finished_message(rows: Sequence[Mapping[str, Any]], reply_id: str) -> Message:
    """The message of a reply that someone else already finished, from _MESSAGE_OF_REPLY's rows
    (the second save of every reply, the relay's or the recorder's, may come here)."""
    if not rows:
        raise NotFound(f"reply {reply_id}")
    row = rows[0]
    if row["id"] is None:
        raise ReplyFinished(reply_id, ReplyState(row["reply_state"]))
    return _message({name: row[name] for name in messages.c.keys()})


def _bound(values: Mapping[str, Any]) -> dict[str, Any]:
    return {f"b_{column}": value for column, value in values.items()}


def _ending(ending: Ending) -> tuple[dict[str, Any], Message]:
    """The reply's final columns and its message (conversation id not known yet)."""
    finish_reason = ending.finish_reason
    if finish_reason is None and ending.status is MessageStatus.FLAGGED:
        finish_reason = "content_filter"  # what the OpenAI API reports for a filtered reply
    ts = now()
    final = {"state": STATE_OF_STATUS[ending.status].value, "finish_reason": finish_reason, "finished_at": ts}
    if ending.last_event_id is not None:
        final["last_event_id"] = ending.last_event_id
    msg = Message(id=new_id("msg"), conversation_id="", role=Role.ASSISTANT, text=ending.text, status=ending.status,
                  created_at=ts, reply_id=ending.reply_id, prompt_tokens=ending.prompt_tokens,
                  completion_tokens=ending.completion_tokens, cached_tokens=ending.cached_tokens, tools=ending.tools,
                  flagged_categories=ending.flagged_categories)
    return final, msg


def _finish_params(reply_id: str, final: Mapping[str, Any], msg: Message) -> dict[str, Any]:
    """_finish_statement's parameters."""
    return {"b_id": reply_id, **_bound(final),
            **{f"m_{k}": v for k, v in _values(msg).items() if k != "conversation_id"}}


class SqlConversationStore(ConversationStore):
    def __init__(self, url: str, **engine_kwargs: Any):
        # A PostgreSQL URL's libpq parameters (?sslmode=...) as asyncpg's connect_args: the engine's
        # and the hot path's alike. ValueError here, at start, for one asyncpg cannot take.
        url, connect_args = engine_args(url, engine_kwargs.pop("connect_args", None))
        self.url = url
        self._engine = create_async_engine(url, connect_args=connect_args,
                                           **{**_engine_options(url), **engine_kwargs})
        self._dialect = self._engine.dialect.name
        insert = postgresql.insert if self._dialect == "postgresql" else sqlite.insert
        self._add_usage = (insert(usage_records).on_conflict_do_nothing(index_elements=["reply_id"])
                           .returning(usage_records.c.reply_id))
        if self._dialect == "sqlite":
            sa.event.listen(self._engine.sync_engine, "connect", _sqlite_pragmas)
        else:
            sa.event.listen(self._engine.sync_engine, "checkout", _replace_closed)
        # PostgreSQL runs a lone statement atomically by itself: on an autocommit connection it goes
        # without the BEGIN and COMMIT (or ROLLBACK, after a read) around it, 1 round trip, not 3.
        # SQLite opens no transaction for a read anyway, and switching its mode costs a thread hop.
        self._autocommit = (self._engine.execution_options(isolation_level="AUTOCOMMIT")
                            if self._dialect == "postgresql" else None)
        # The chat path's single statements skip the engine on PostgreSQL (hot_path.py).
        self._hot_path: PostgresHotPath | None = None
        if self._dialect == "postgresql":
            self._hot_path = PostgresHotPath.of_engine(self._engine, connect_args)

    async def _rows(self, statement: sa.Executable, params: Mapping[str, Any],
                    write: bool = False) -> Sequence[Mapping[str, Any]]:
        """One statement, alone (a read, or a write PostgreSQL runs atomically by itself): its rows.
        On asyncpg's pool on PostgreSQL; through the engine on SQLite, a write after this
        process's earlier writers."""
        if self._hot_path is not None:
            with reaching_database():
                return await self._hot_path.fetch(statement, params)
        return await self._rows_many(statement, [params], write)

    async def _rows_many(self, statement: sa.Executable, params_list: Sequence[Mapping[str, Any]],
                         write: bool = False) -> Sequence[Mapping[str, Any]]:
        """One statement per set of parameters, in one round trip on PostgreSQL (pipelined, in one
        transaction); in one transaction on SQLite. The rows of all, in order."""
        if self._hot_path is not None:
            with reaching_database():
                return await self._hot_path.fetch_many(statement, params_list)
        if not params_list:
            return []
        rows: list[Mapping[str, Any]] = []
        async with self._writing() if write else self._one_statement() as conn:
            for params in params_list:
                result = await conn.execute(statement, params)
                if result.returns_rows:
                    rows += result.mappings().all()
        return rows

    async def _read(self, statement: sa.Executable, params: Mapping[str, Any],
                    conn: AsyncConnection | None = None) -> Sequence[Mapping[str, Any]]:
        """A read's rows: inside the caller's transaction when it names one, else as _rows."""
        if conn is None:
            return await self._rows(statement, params)
        return (await conn.execute(statement, params)).mappings().all()

    @contextlib.asynccontextmanager
    async def _one_statement(self) -> AsyncIterator[AsyncConnection]:
        """A connection for a single read (a single write goes through _rows)."""
        with reaching_database():
            async with self._autocommit.connect() if self._autocommit is not None else self._engine.begin() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[AsyncConnection]:
        """A transaction that writes, committed at the end. On SQLite, after this process's
        earlier writers (_sqlite_write_lock)."""
        with reaching_database():
            if self._dialect != "sqlite":
                async with self._engine.begin() as conn:
                    yield conn
                return
            async with _sqlite_write_lock(self.url), self._engine.begin() as conn:
                yield conn

    async def init(self) -> None:
        with reaching_database():
            await migrate(self._engine)

    async def close(self) -> None:
        if self._hot_path is not None:
            await self._hot_path.close()
        await self._engine.dispose()

    @contextlib.asynccontextmanager
    async def one_connection(self) -> AsyncIterator[None]:
        if self._hot_path is None:
            yield
            return
        async with contextlib.AsyncExitStack() as stack:
            with reaching_database():  # the checkout's errors; the block's own pass as they are
                await stack.enter_async_context(self._hot_path.one_connection())
            yield

    # conversations

    async def get_conversation(self, id: str, user_id: str) -> Conversation | None:
        rows = await self._rows(_CONVERSATION_OF_USER, {"b_id": id, "b_user": user_id})
        return _conversation(rows[0]) if rows else None

    async def list_conversations(
        self, user_id: str, limit: int = 50, before: float | None = None
    ) -> list[Conversation]:
        query = sa.select(*_CONVERSATION_COLUMNS).where(conversations.c.user_id == user_id)
        if before is not None:
            query = query.where(conversations.c.updated_at < before)
        query = query.order_by(conversations.c.updated_at.desc(), conversations.c.id.desc()).limit(limit)
        async with self._one_statement() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [_conversation(r) for r in rows]

    async def delete_conversation(self, id: str, user_id: str) -> bool:
        owned = (
            sa.select(conversations.c.id)
            .where(conversations.c.id == id, conversations.c.user_id == user_id)
            .with_for_update()  # PostgreSQL: holds off new messages until the delete commits
        )
        async with self._writing() as conn:
            if (await conn.execute(owned)).first() is None:
                return False
            # Children first: the foreign keys point at the conversation.
            await conn.execute(sa.delete(replies).where(replies.c.conversation_id == id))
            await conn.execute(sa.delete(messages).where(messages.c.conversation_id == id))
            await conn.execute(sa.delete(conversations).where(conversations.c.id == id))
        return True

    async def _touch(self, conn: AsyncConnection, conversation_id: str, ts: float) -> bool:
        """Bump updated_at so the conversation lists first; False if it does not exist."""
        result = await conn.execute(_TOUCH, {"b_id": conversation_id, "b_ts": ts})
        return result.rowcount > 0

    # messages

    async def store_turn(self, turn: NewTurn) -> tuple[Message, Reply | None]:
        # What used to be four separate writes (conversation, its touch, the message, the reply):
        # one statement on PostgreSQL (_turn_statement), one transaction on SQLite. Each statement
        # costs the gateway CPU and a round trip (on SQLite, a hop to the connection's thread and
        # back).
        conv = turn.conversation
        last = len(turn.messages) - 1
        flagged = {**turn.flagged_earlier, last: turn.flagged_categories} if turn.flagged else {}
        msgs = [Message(id=new_id("msg"), conversation_id=conv.id, role=Role(item[0]), text=item[1],
                        client_key=turn.client_key if i == last else None,
                        status=MessageStatus.FLAGGED if i in flagged else MessageStatus.COMPLETE, created_at=now(),
                        tools=item[2] if len(item) > 2 else None,
                        attachments=list(item[3]) if len(item) > 3 and item[3] else None,
                        flagged_categories=list(flagged[i]) if i in flagged else None)
                for i, item in enumerate(turn.messages)]
        reply = Reply(id=new_id("rep"), conversation_id=conv.id, message_id=msgs[-1].id,
                      state=ReplyState.SHED if turn.shed else ReplyState.QUEUED, replica_id=turn.replica_id,
                      prompt_token_ids=list(turn.prompt_token_ids) if turn.prompt_token_ids is not None else None,
                      created_at=now(), job=turn.job)
        if turn.shed:
            reply.finished_at = reply.created_at
        claim = None if turn.flagged else reply.id
        try:
            if self._dialect == "postgresql":
                if not await self._store_turn_at_once(turn, msgs, reply):
                    raise await self._not_stored(conv.id, turn.client_key)
                return msgs[-1], None if turn.flagged else reply
            async with self._writing() as conn:
                if turn.new_conversation:
                    await conn.execute(_INSERT["conversations"], {**_values(conv), "active_reply_id": claim})
                # The update takes SQLite's write lock before the inserts, and tells a missing
                # (or busy) conversation apart.
                elif not await self._claim(conn, conv.id, msgs[0].created_at, claim):
                    raise await self._not_stored(conv.id, turn.client_key, conn)
                rows = [_values(m) for m in msgs]
                await conn.execute(_INSERT["messages"], rows if len(rows) > 1 else rows[0])
                if not turn.flagged:
                    await conn.execute(_INSERT["replies"], _values(reply))
        except IntegrityError:
            # A key already taken: the same request raced in twice and the other one stored its
            # turn first (a new conversation's id derives from the client key, so it collides too).
            existing = (await self.get_message_by_client_key(conv.id, turn.client_key)
                        if turn.client_key else None)
            if existing is None:
                raise
            raise DuplicateClientKey(existing) from None
        return msgs[-1], None if turn.flagged else reply

    async def _store_turn_at_once(self, turn: NewTurn, msgs: list[Message], reply: Reply) -> bool:
        """PostgreSQL: the turn in one statement; False if nothing was stored (_not_stored says why)."""
        conv = turn.conversation
        values = {} if turn.flagged else {f"r_{k}": v for k, v in _values(reply).items()}
        for i, msg in enumerate(msgs):
            values.update({f"m{i}_{k}": v for k, v in _values(msg).items()})
        if turn.new_conversation:
            values.update({f"c_{k}": v for k, v in _values(conv).items()})
            values["c_active_reply_id"] = None if turn.flagged else reply.id
        else:
            values.update(t_id=conv.id, t_ts=msgs[0].created_at)
        return bool(await self._rows(_turn_statement(turn.new_conversation, len(msgs), not turn.flagged), values,
                                     write=True))

    async def _claim(self, conn: AsyncConnection, conversation_id: str, ts: float, reply_id: str | None) -> bool:
        """Bump updated_at and, for a turn with a reply, make it the conversation's newest if the
        one before has ended; False if that failed (or the conversation does not exist)."""
        if reply_id is None:
            return await self._touch(conn, conversation_id, ts)
        result = await conn.execute(_CLAIM, {"b_id": conversation_id, "b_ts": ts, "b_reply": reply_id})
        return result.rowcount > 0

    async def _not_stored(self, conversation_id: str, client_key: str | None,
                          conn: AsyncConnection | None = None) -> StoreError:
        """Why a turn for an existing conversation stored nothing: its client key is taken (the same
        message raced in twice), the conversation is busy, or it is gone."""
        if client_key and (existing := await self.get_message_by_client_key(conversation_id, client_key, conn)):
            return DuplicateClientKey(existing)
        rows = await self._read(_ACTIVE_REPLY, {"b_id": conversation_id}, conn)
        if not rows:
            return NotFound(f"conversation {conversation_id}")
        return ConversationBusy(conversation_id, rows[0]["active_reply_id"])

    async def add_reply(self, conversation_id: str, message_id: str, prompt_token_ids: Sequence[int] | None,
                        replica_id: str | None, job: dict[str, Any], shed: bool = False) -> Reply:
        reply = Reply(id=new_id("rep"), conversation_id=conversation_id, message_id=message_id,
                      state=ReplyState.SHED if shed else ReplyState.QUEUED, replica_id=replica_id,
                      prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
                      created_at=now(), job=job)
        reply.finished_at = reply.created_at if shed else None
        async with self._writing() as conn:
            if not await self._claim(conn, conversation_id, reply.created_at, reply.id):
                raise await self._not_stored(conversation_id, None, conn)
            await conn.execute(_INSERT["replies"], _values(reply))
        return reply

    async def list_messages(self, conversation_id: str) -> list[Message]:
        return [_message(r) for r in await self._rows(_MESSAGES_OF, {"b_conversation": conversation_id})]

    async def get_message_by_client_key(self, conversation_id: str, client_key: str,
                                        conn: AsyncConnection | None = None) -> Message | None:
        rows = await self._read(_MESSAGE_BY_CLIENT_KEY, {"b_conversation": conversation_id, "b_key": client_key}, conn)
        return _message(rows[0]) if rows else None

    # replies

    async def get_reply(self, id: str) -> Reply | None:
        rows = await self._rows(_REPLY_BY_ID, {"b_id": id})
        return _reply(rows[0]) if rows else None

    async def get_reply_jobs(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        rows = await self._rows_many(_JOB_OF_REPLY, [{"b_id": id} for id in ids])
        return {row["id"]: row["job"] for row in rows if row["job"]}

    async def get_finish_reasons(self, ids: Sequence[str]) -> dict[str, str]:
        rows = await self._rows_many(_FINISH_REASON_OF_REPLY, [{"b_id": id} for id in ids])
        return {row["id"]: row["finish_reason"] for row in rows if row["finish_reason"]}

    async def get_reply_for_message(self, conversation_id: str, message_id: str) -> Reply | None:
        query = (
            sa.select(replies)
            .where(replies.c.conversation_id == conversation_id, replies.c.message_id == message_id)
            .order_by(replies.c.created_at.desc())
            .limit(1)
        )
        async with self._one_statement() as conn:
            row = (await conn.execute(query)).mappings().first()
        return _reply(row) if row else None

    async def update_reply(self, id: str, **fields: Any) -> Reply | None:
        unknown = fields.keys() - REPLY_UPDATABLE
        if unknown:
            raise TypeError(f"update_reply cannot set {sorted(unknown)}")
        if not fields:
            return await self.get_reply(id)
        values = dict(fields)
        if "state" in values:
            state = ReplyState(values["state"])
            values["state"] = state.value
            if state.terminal:
                values["finished_at"] = now()
        if values.get("prompt_token_ids") is not None:
            values["prompt_token_ids"] = list(values["prompt_token_ids"])
        rows = await self._rows(_update_reply_statement(frozenset(values)), {"b_id": id, **_bound(values)}, write=True)
        if rows:
            return _reply(rows[0])
        current = await self.get_reply(id)
        if current is None:
            return None
        raise ReplyFinished(id, current.state)

    async def claim_restart(self, id: str, restarts: int, replica_id: str) -> Reply | None:
        rows = await self._rows(_CLAIM_RESTART, {"b_id": id, "b_restarts": restarts, "b_replica": replica_id},
                                write=True)
        return _reply(rows[0]) if rows else None

    async def mark_running_many(self, started: Sequence[tuple[str, str]]) -> int:
        return await self._place_many(started, ReplyState.RUNNING)

    async def mark_requeued_many(self, requeued: Sequence[tuple[str, str]]) -> int:
        return await self._place_many(requeued, ReplyState.QUEUED)

    async def _place_many(self, placed: Sequence[tuple[str, str]], state: ReplyState) -> int:
        params = [{"b_id": reply_id, **_bound({"state": state.value, "replica_id": replica_id})}
                  for reply_id, replica_id in placed]
        return len(await self._rows_many(_update_reply_statement(_PLACED, whole_row=False), params, write=True))

    async def finish_reply(
        self,
        reply_id: str,
        text: str,
        status: MessageStatus,
        finish_reason: str | None = None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
        last_event_id: int | None = None,
        look_up_existing: bool = True,
        tools: dict[str, Any] | None = None,
        flagged_categories: list[str] | None = None,
    ) -> Message | None:
        final, msg = _ending(Ending(reply_id, text, MessageStatus(status), finish_reason, prompt_tokens,
                                    completion_tokens, cached_tokens, last_event_id, tools, flagged_categories))
        ts = msg.created_at
        if self._dialect == "postgresql":
            rows = await self._rows(_finish_statement(frozenset(final)), _finish_params(reply_id, final, msg),
                                    write=True)
            if rows:
                msg.conversation_id = rows[0]["conversation_id"]
                return msg
            return _finished_message(await self._rows(_MESSAGE_OF_REPLY, {"b_id": reply_id}), reply_id) \
                if look_up_existing else None
        async with self._writing() as conn:
            mark = _update_reply_statement(frozenset(final), whole_row=False)
            row = (await conn.execute(mark, {"b_id": reply_id, **_bound(final)})).first()
            if row is not None:
                msg.conversation_id = row.conversation_id
                await conn.execute(_INSERT["messages"], _values(msg))
                await self._touch(conn, msg.conversation_id, ts)
                return msg
            if not look_up_existing:
                return None
            return _finished_message((await conn.execute(_MESSAGE_OF_REPLY, {"b_id": reply_id})).mappings().all(),
                                     reply_id)

    async def finish_replies(self, endings: Sequence[Ending]) -> None:
        if self._dialect != "postgresql":
            await super().finish_replies(endings)
            return
        batches: dict[frozenset[str], list[dict[str, Any]]] = {}
        for ending in endings:
            final, msg = _ending(ending)
            batches.setdefault(frozenset(final), []).append(_finish_params(ending.reply_id, final, msg))
        for columns, params in batches.items():
            await self._rows_many(_finish_statement(columns), params, write=True)

    async def unfinished_reply_ids(self, created_before: float) -> list[str]:
        rows = await self._rows(_UNFINISHED_BEFORE, {"b_before": created_before})
        return [row["id"] for row in rows]

    async def list_unfinished_replies(self) -> list[Reply]:
        query = sa.select(replies).where(replies.c.finished_at.is_(None)).order_by(replies.c.created_at)
        async with self._one_statement() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [_reply(r) for r in rows]

    # API keys

    async def add_api_key(self, key: ApiKey) -> ApiKey:
        try:
            await self._rows(_INSERT["api_keys"], _values(key), write=True)
        except IntegrityError as e:
            raise DuplicateKey(f"key {key.prefix}... is already stored") from e
        return key

    async def get_api_key(self, key_hash: str) -> ApiKey | None:
        async with self._one_statement() as conn:
            row = (await conn.execute(sa.select(api_keys).where(api_keys.c.key_hash == key_hash))).mappings().first()
        return ApiKey(**row) if row else None

    async def revoke_api_key(self, id_or_hash: str) -> ApiKey | None:
        which = sa.or_(api_keys.c.id == id_or_hash, api_keys.c.key_hash == id_or_hash)
        async with self._writing() as conn:
            await conn.execute(
                sa.update(api_keys).where(which, api_keys.c.revoked_at.is_(None)).values(revoked_at=now())
            )
            row = (await conn.execute(sa.select(api_keys).where(which))).mappings().first()
        return ApiKey(**row) if row else None

    async def list_api_keys(self, user_id: str | None = None) -> list[ApiKey]:
        query = sa.select(api_keys).order_by(api_keys.c.created_at, api_keys.c.id)
        if user_id is not None:
            query = query.where(api_keys.c.user_id == user_id)
        async with self._one_statement() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [ApiKey(**r) for r in rows]

    # usage

    async def add_usage_many(self, records: Sequence[UsageRecord]) -> set[str]:
        # A reply's record that is there already (unique reply_id) is left as it is.
        rows = await self._rows_many(self._add_usage, [_values(record) for record in records], write=True)
        return {row["reply_id"] for row in rows}

    async def get_usage(self, reply_id: str) -> UsageRecord | None:
        query = sa.select(usage_records).where(usage_records.c.reply_id == reply_id)
        async with self._one_statement() as conn:
            row = (await conn.execute(query)).mappings().first()
        return UsageRecord(**row) if row else None

    async def flagged_totals(self, user_id: str, since: float, until: float) -> dict[str, dict[str, int]]:
        m = messages.c
        query = (sa.select(m.role, m.flagged_categories)
                 .join_from(messages, conversations, conversations.c.id == m.conversation_id)
                 .where(conversations.c.user_id == user_id, m.status == MessageStatus.FLAGGED.value,
                        m.created_at >= since, m.created_at < until))
        async with self._one_statement() as conn:
            rows = (await conn.execute(query)).all()
        totals: dict[str, dict[str, int]] = {"input": {}, "output": {}}
        for role, categories in rows:
            stage = totals["input" if role == Role.USER.value else "output"]
            # None: flagged before categories were kept; []: refused with a flagged message before it
            for category in ["unknown"] if categories is None else categories:
                stage[category] = stage.get(category, 0) + 1
        return totals

    async def usage_totals(self, user_id: str, first_day: str, last_day: str) -> list[dict[str, Any]]:
        u = usage_records.c
        query = (
            sa.select(
                u.day,
                u.model,
                sa.func.count().label("requests"),
                sa.func.sum(u.prompt_tokens).label("prompt_tokens"),
                sa.func.sum(u.cached_tokens).label("cached_tokens"),
                sa.func.sum(u.completion_tokens).label("completion_tokens"),
                sa.func.sum(u.cost).label("cost"),
            )
            .where(u.user_id == user_id, u.day >= first_day, u.day <= last_day)
            .group_by(u.day, u.model)
            .order_by(u.day, u.model)
        )
        async with self._one_statement() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [
            {"day": r["day"], "model": r["model"], "requests": int(r["requests"]),
             "prompt_tokens": int(r["prompt_tokens"] or 0), "cached_tokens": int(r["cached_tokens"] or 0),
             "completion_tokens": int(r["completion_tokens"] or 0), "cost": float(r["cost"] or 0.0)}
            for r in rows
        ]
