"""``python -m cloudckpt``: the command line (see :mod:`cloudckpt.cli`)."""

from __future__ import annotations

from cloudckpt.cli import main

if __name__ == "__main__":  # spawned ranks import this module as __mp_main__
    raise SystemExit(main())
