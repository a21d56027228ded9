"""Fetching a blob from many peers: the scheduler (which chunk from which peer, sans-IO;
striping one provider over several connections and peer scores beside it),
the downloader (manifest, providers, the verified chunk stream), the chunk writer (hashing
and writing off the event loop), peer memory (scores kept across runs) and tensor fetches
(named tensors of a safetensors blob). Below it: ``p2p.blob`` and ``p2p.transport``.
"""
