"""Everything that knows py-libp2p's insides: the host builder and its inbound gate
(``host``), dialable addresses for a wildcard listener (``addresses``), the fast Noise and
yamux data path (``fast``) and the socket byte meter (``meter``). Nothing above this room
reaches into py-libp2p's private attributes.
"""
