"""``python -m tokenwire ...`` is ``tokenwire ...``."""

from tokenwire.sidecar.tools.cli import main

raise SystemExit(main())
