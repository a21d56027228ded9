"""``python -m p2p.cli``: the ``blob`` command."""

from p2p.cli.main import main

main()
