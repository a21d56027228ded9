"""A running node's local API (a Unix socket in its store), its status and its metrics.

``server``: the API a ``blob serve`` runs, with ``slots`` (each listener's budgets of
connections and clients) and ``paths`` (what a ``put`` may have it read, for whom);
``scrape``: the metrics endpoint over HTTP; ``client``: what commands on the same store use
to reach it; ``status``: what the node shows of itself; ``api``: the wire format, without
I/O. ``API.md`` beside this file is the contract. This room sits between the CLI above and
the node below.
"""
