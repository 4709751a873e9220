"""tokenwire: the wire between LLM engines and the people reading their answers.

Three packages, mapped from the repository's top-level folders:

- ``tokenwire.middleware``: the sans-IO wire core and the ASGI middleware;
- ``tokenwire.sidecar``: the reverse proxy; ``tokenwire.tools``: the
  ``tokenwire`` command and its tools (``up``, ``demo``, ``probe``);
- ``tokenwire.engine``: the torch + transformers engine (the ``engine`` extra).

This package only holds them together (and ``python -m tokenwire``); it
imports none of them, so importing one never drags in another.
docs/architecture.md in the repository says what lives where.
"""

from . import pure_python as _pure_python

if _pure_python.wanted():  # TOKENWIRE_PURE_PYTHON=1: skip the compiled modules (scripts/compile-core.sh)
    _pure_python.install()
