"""``python -m tokenwire.sidecar ...`` is ``tokenwire ...``."""

from tokenwire.tools.cli import main

raise SystemExit(main())
