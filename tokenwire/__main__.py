"""``python -m tokenwire ...`` is ``tokenwire ...``."""

from tokenwire.tools.cli import main

raise SystemExit(main())
