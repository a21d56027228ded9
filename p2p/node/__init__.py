"""The node: a libp2p host that serves and fetches blobs (``node``), its blocking facade
(``blocking``), dialling by address or ticket (``dial``) and gossip (``gossip``). It ties
the rooms below it together: ``p2p.names`` and ``p2p.nat``, ``p2p.fetch``, ``p2p.blob``,
``p2p.transport``.
"""
