"""``python -m tokenwire.sidecar ...`` is ``tokenwire ...``."""

from .tools.cli import main

raise SystemExit(main())
