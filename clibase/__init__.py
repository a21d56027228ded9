"""What every package of the ``blob`` program shares with the people and scripts that run
it, below every package (the first floor of the layers contract in ``pyproject.toml``):

1. :mod:`clibase.exitcodes`: the program's exit statuses (README "Exit codes"). Every
   package's errors carry one as their ``exit_code``; no package owns the table, so it
   lives beneath them all rather than in any one of them.
2. :mod:`clibase.options`: the ``--json`` option, declared once for every command that
   has a machine-readable form. It needs click, so it is its own module: the exit codes
   stay importable without it (the light path of ``blob get`` never loads click).
"""
