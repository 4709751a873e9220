"""tokenwire.tools: the tools around the proxy, not the proxy.

- ``cli``: the ``tokenwire`` command (``python -m tokenwire``), one argparse
  subcommand per tool and for the sidecar and the engine;
- ``up``: the engine and a sidecar together, for trying it out;
- ``demo``: the guided tour over real sockets;
- ``probe``: what a client sees on a stream (TTFT, gaps, truncation);
- ``playground``: the page the admin port serves at ``/``.

Nothing in ``tokenwire.sidecar`` proper imports from here but the admin
server (the playground page) and ``python -m tokenwire.sidecar`` (the CLI).
"""
