"""The blob protocol (``PROTOCOL.md``): the sans-IO core (``protocol``: framing, messages,
limits, versions), its trio shell (``shell``: the client and the stream helpers), the
server and its upload pacing, the chunk buffers both sides read into, the swarm's fetching
board (``swarm``: who fetches what from a server, told to fellow fetchers) and tickets.

Import order: ``protocol`` < ``buffers``, ``swarm``, ``ticket`` < ``shell`` < ``pacing`` <
``server``. Below it: ``p2p.transport``.
"""
