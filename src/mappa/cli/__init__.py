"""`mappa` command line: train, eval, rollout, coach, serve, export, sandbox, trace, probe, report, blame, compare,
dsbench, config.

The CLI layer is the edge: every command and all console output live in `mappa.cli.<command>`; domain
modules return records and take an optional progress callback. `parser.py` (the parser and `main`) only parses
arguments and imports each command's module lazily, so that `mappa sandbox run` does not pay for importing torch.
User errors (MappaError) print one line and exit 2, and so does an exception raised in the user's own code (a
plug-in), named by its file and line (`mappa.plugins.user_code_error`); `--debug` or `MAPPA_DEBUG=1` prints the
whole traceback too. `mappa train` exits 3 when no agent's weights moved (a warning line says why); Ctrl-C
exits 130.
"""

from mappa.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
