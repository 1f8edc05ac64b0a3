"""`python -m toolloop_fsm` is the `toolloop-fsm` command."""

from toolloop_fsm.cli import main

raise SystemExit(main())
