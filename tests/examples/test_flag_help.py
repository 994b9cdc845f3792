"""Every flag of the two entry points (examples/serve.py, examples/generate.py) says what it is
for in `--help`: the engine's, kvgraph's and the script's own."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")  # examples/serve.py needs the serve extra

from examples import generate, serve  # noqa: E402


@pytest.mark.parametrize("script", [serve, generate], ids=["serve", "generate"])
def test_every_flag_has_help_text(script):
    parser = script.build_parser()
    silent = [action.option_strings or [action.dest] for action in parser._actions
              if action.dest != "help" and not (action.help or "").strip()]
    assert not silent, f"flags without help text in examples/{script.__name__.split('.')[-1]}" \
                       f".py: {silent}"
    assert parser.format_help()  # every %(default)s in the help strings formats
