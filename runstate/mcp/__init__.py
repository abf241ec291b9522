"""``runstate mcp``: a Model Context Protocol server that lets an agent join a swarm.

A client of the HTTP API through the async SDK, like any worker (it imports no Django). One
server definition (``runstate.mcp.server.build_server``) serves stdio (``runstate mcp``) and
streamable HTTP at ``/mcp`` (``runstate mcp --http HOST:PORT``). Needs the ``mcp`` package
(``pip install 'runstate[mcp]'``); ``docs/mcp.md`` is the user's guide.
"""
