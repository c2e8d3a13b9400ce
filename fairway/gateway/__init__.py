"""The gateway: the ASGI app clients talk to (OpenAI-compatible chat API, SSE relay, resume,
stop, conversations). Stateless: any gateway can serve any request or reconnect."""

from fairway.gateway.app import create_app
from fairway.gateway.app_state import GatewayContext

__all__ = ["GatewayContext", "create_app"]
