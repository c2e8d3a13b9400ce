"""What the routes work with: one GatewayContext per app, on app.state.gateway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from fairway.conversation import ConversationStore
from fairway.conversation.service import ConversationService
from fairway.gateway.keys import KeyChecker
from fairway.gateway.streaming import ReplyRelay
from fairway.limits import Limits
from fairway.relay import TokenLog
from fairway.router import Router
from fairway.safety import Moderator
from fairway.usage.accounting import Accounting

if TYPE_CHECKING:  # memory and files load the embedding model's libraries only where configured
    from fairway.files import FileService
    from fairway.memory import MemoryService

Hook = Callable[[], Awaitable[None]]


@dataclass
class GatewayContext:
    service: ConversationService
    relay: ReplyRelay
    token_log: TokenLog
    store: ConversationStore
    router: Router
    limits: Limits
    keys: KeyChecker
    memory: MemoryService | None = None  # None: memory is off (memory_off_reason says why)
    memory_off_reason: str | None = None
    files: FileService | None = None
    moderator: Moderator | None = None  # /v1/moderations (the service's input check has its own reference)
    accounting: Accounting | None = None  # bills the requests that shared another's generation
    on_startup: list[Hook] = field(default_factory=list)  # e.g. store.init, the recorder, an embedded replica
    on_shutdown: list[Hook] = field(default_factory=list)

    @property
    def default_model(self) -> str:
        """The model the x-ratelimit-*-tokens headers describe on routes that name none."""
        return next(iter(self.service.tokenizers), "")


def gateway(request: Request) -> GatewayContext:
    return request.app.state.gateway

