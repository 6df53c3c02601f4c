"""``python -m ortpass``: the ``ortpass`` command."""

from ortpass.cli import main

raise SystemExit(main())
