"""``python -m tokenwire ...`` is ``tokenwire ...``."""

from tokenwire.sidecar.cli import main

raise SystemExit(main())
