"""``python -m p2p.cli``: the ``blob`` command."""

from p2p.cli import main

main()
