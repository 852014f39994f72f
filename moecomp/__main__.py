"""``python -m moecomp`` -> :func:`moecomp.cli.main`."""

from .cli import main

raise SystemExit(main())
