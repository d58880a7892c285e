"""Run ``dsedge``'s CLI entry point in process and capture what a user would see."""
from __future__ import annotations

import pytest


def run_main(args, capsys) -> tuple[int, str, str]:
    """``dsedge.cli.main(args)`` (each arg str()-ed) → (exit code, stdout, stderr)."""
    from dsedge.cli import main

    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
