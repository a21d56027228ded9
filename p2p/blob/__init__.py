"""The blob protocol (``PROTOCOL.md``): the sans-IO core (``messages``: versions, limits,
events and their encoding; ``protocol``: the two sides of a stream), its trio shell
(``shell``: the client and the stream helpers), the server and its upload pacing, the
chunk buffers both sides read into, the swarm's fetching board (``swarm``: who fetches what
from a server, told to fellow fetchers) and tickets.

Import order: ``messages`` < ``protocol`` < ``buffers``, ``swarm``, ``ticket`` < ``shell``
< ``pacing`` < ``server``. Below it: ``p2p.transport``.
"""
