"""A discrete-event simulator of blobnet at internet scale, driving the project's own deciding
code (DESIGN section 9): the fetch scheduler and its parts, the serving rules, and the outer
loop's agreement code, each in simulated time through a thin shell.

Why SimPy. The deciding code is sans-IO and takes ``now``, so it can run in any clock.
trio's ``MockClock`` over the real shells would run the real downloader and server tasks,
but those own streams, stores and files: a thousand fetchers of a 1 GiB blob would each hold
a store and a buffer pool, and every chunk would cross a real yamux stream in memory. SimPy
(DESIGN section 10, the bench extra) gives a plain event queue with timeouts and callbacks:
the network is a fluid model on it, and the shells are small enough to state beside the
code what they do by hand (bench.sim.fetch, bench.sim.node, bench.sim.outer).

The layout, from the bottom up: `fluid` (links, TCP connections as pipes sharing them
max-min fairly, messages), `world` (one run: the environment, network, nodes, regions),
`node` (a node's holdings and its server), `fetch` (one download through the real
``Scheduler``), `gossip` (a gossipsub mesh), `fanout` and `outer` (scenarios), `calibrate`
(the same fan-out as real processes on bench/wan's testbed), `figures` (tables and plots).

    python -m bench.sim fanout --fetchers 1000 --size-mib 1024 --json-out F [--plot P]
    python -m bench.sim outer --workers 256 --compute 60 [--churn 0.1] --json-out F
    python -m bench.sim.calibrate --workers 4 8 16 --runs 2 --json-out F    (root)
"""
