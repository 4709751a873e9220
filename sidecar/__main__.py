"""``python -m tokenwire.sidecar ...`` is ``tokenwire ...``."""

from .cli import main

raise SystemExit(main())
