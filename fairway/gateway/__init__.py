"""The gateway: the ASGI app clients talk to (OpenAI-compatible chat API, SSE relay, resume,
stop, conversations). Stateless: any gateway can serve any request or reconnect.

The app and its context are imported on first use: they load FastAPI and the whole serving path,
which a command that needs one submodule alone (`fairway keys`: keys.py) would otherwise wait for
at every start."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fairway.gateway.app import create_app
    from fairway.gateway.app_state import GatewayContext

__all__ = ["GatewayContext", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from fairway.gateway.app import create_app

        return create_app
    if name == "GatewayContext":
        from fairway.gateway.app_state import GatewayContext

        return GatewayContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
