"""What every tool module shares: the answer type, the annotation sets, the common argument types."""

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from runstate._config import JsonDict
from runstate.mcp.session import Session

# The structured output of every tool: the API's object(s), plus ``cancellation`` while claims are held.
Answer = Annotated[CallToolResult, dict[str, Any]]
# ``answer(ctx, do)``: run ``do`` with the session's runstate state and turn its end into a tool result.
Answerer = Callable[..., Awaitable[CallToolResult]]
Doer = Callable[[Session], Awaitable[JsonDict]]
# What a cancelled call hands back (``answer(..., undo=...)``).
Undoer = Callable[[Session], Awaitable[None]]
# ``tool(name, annotations, title)``: the server's decorator registering a tool.
ToolDecorator = Callable[[str, ToolAnnotations, str], Callable[[Any], Any]]
Ctx = Context

READ = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
CREATE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
CHANGE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
DESTROY = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)

RunId = Annotated[str, Field(description="The run's id.")]
Mailbox = Annotated[str, Field(description="The WORK mailbox's name.")]
ClaimId = Annotated[str, Field(description="The claimId that task_claim answered.")]
TimeoutMs = Annotated[
    int, Field(ge=0, le=600_000, description="How long to wait, in milliseconds, before answering the current state.")
]


async def wrap(name: str, call: Awaitable[JsonDict]) -> JsonDict:
    """Await ``call`` and answer its object under ``name``."""
    return {name: await call}
