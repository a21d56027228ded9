"""The options of a fetch (``blob get``), as one table: each option's name, kind, bounds
and help. Three readers are built from it, so that none can drift from the others:

1. the click command ``blob get`` (p2p.cli.get), an option per row, in this order; a row
   with ``shared`` is declared by that decorator of p2p.cli.common or p2p.cli.nat (the
   option other commands take too), and the command checks, when it is built, that the
   decorator declares the row's name, destination and kind;
2. the light path's parser (p2p.cli.light), which takes the rows marked ``light``;
3. the checks of a fetch request (p2p.node.request.FetchOptions), which read the bounds.

Standard library only: the light path imports this module (tests/p2p/test_cli_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# How an option takes its values: a switch, one value, one value per use, or a count.
FLAG, VALUE, MULTI, COUNT = "flag", "value", "multi", "count"
# The kinds of value (VALUE rows): text, a path, a number, a rate in MB/s (finite, and at
# least the pacer's floor, p2p.blob.pacing.MIN_UPLOAD_LIMIT).
TEXT, PATH, NUMBER, RATE = "text", "path", "number", "rate"

# --seed-for's ceiling: a day; a longer-lived seeder is `blob serve`.
MAX_SEED_SECONDS = 86400.0
# A punch longer than this is not going to work (py-libp2p's DCUtR gives up after 25 s).
MIN_PUNCH_TIMEOUT = 1  # an int: --help shows "1<=x"
MAX_PUNCH_TIMEOUT = 300.0


@dataclass(frozen=True)
class Option:
    """One option: ``names`` as typed (``-o``, ``--output``), ``dest`` the keyword it
    arrives as, ``kind`` FLAG/VALUE/MULTI/COUNT, ``value`` (VALUE rows) its type, and
    ``low``/``high`` a number's bounds."""

    names: tuple[str, ...]
    dest: str
    kind: str
    help: str = ""
    value: str = TEXT
    metavar: str | None = None
    default: float | None = None
    low: float | None = None
    high: float | None = None
    show_default: bool = False
    light: bool = False  # the light path takes it (p2p.cli.light rule 1)
    shared: str | None = None  # declared by this decorator shared with other commands

    @property
    def name(self) -> str:
        """The long name (``--output``)."""
        return self.names[-1]


GET_OPTIONS: tuple[Option, ...] = (
    Option(
        ("-o", "--output"), "output", VALUE, value=PATH,
        help="Write the blob (or a collection's directory) here; PATH/ (a trailing slash) "
        "is a directory, which a one-file blob goes into under its name or ID.",
    ),
    Option(("--peer",), "peers", MULTI, metavar="MADDR", help="Provider (repeatable).",
           light=True),
    Option(("--bootstrap",), "bootstrap", MULTI, shared="bootstrap_option", light=True),
    Option(
        ("--listen",), "listen", MULTI, metavar="MADDR",
        help="Address to serve fellow fetchers and hole-punch from (repeatable; default "
        "/ip4/127.0.0.1/tcp/0 when every peer named is on this machine, else "
        "/ip4/0.0.0.0/tcp/0).",
    ),
    Option(("--no-dht",), "no_dht", FLAG, help="Do not use the DHT even with --bootstrap.",
           light=True),
    Option(("--force",), "force", FLAG,
           help="With -o: replace an existing file that holds other data."),
    Option(("--tag",), "tag_name", VALUE, metavar="NAME",
           help="Tag what was fetched (pins it)."),
    Option(
        ("--include",), "include", MULTI, metavar="GLOB",
        help="Only a collection's files whose path matches (fnmatch, repeatable).",
    ),
    Option(
        ("--tensor",), "tensors", MULTI, metavar="NAME",
        help="Only this tensor of a safetensors blob (or of a sharded model's collection), "
        "fetching just its chunks (repeatable); -o FILE.npy (one) or FILE.npz.",
    ),
    Option(("--link",), "link", FLAG,
           help="With -o: symlinks to the store's read-only files instead of copies."),
    Option(
        ("--discovery-timeout",), "discovery_timeout", VALUE, value=NUMBER, default=10.0,
        show_default=True,
        help="Seconds to keep looking for providers on the DHT when none can serve.",
    ),
    Option(
        ("--no-upload",), "no_upload", FLAG,
        help="Serve nothing while fetching (by default fellow fetchers of the blob may fetch "
        "what has arrived, so a checkpoint crosses its seeder's uplink about once).",
    ),
    Option(("--upload-limit",), "upload_limit", VALUE, value=RATE,
           shared="upload_limit_option"),
    Option(
        ("--download-limit",), "download_limit", VALUE, value=RATE,
        metavar="MB/S",
        help="Receive at most this many MB/s (fetches with a node of this command's own: a "
        "`blob serve`'s cap is its --download-limit).",
    ),
    Option(
        ("--seed-for",), "seed_for", VALUE, value=NUMBER, low=0, high=MAX_SEED_SECONDS,
        metavar="SECONDS",
        help="Once fetched (and written to -o), keep serving it to fellow fetchers this "
        "long; Ctrl-C ends that early (exit 0).",
    ),
    Option(("--via-relay",), "via_relay", FLAG, shared="get_nat_options"),
    Option(("--certificate",), "certificate_path", VALUE, value=PATH,
           shared="get_nat_options"),
    Option(
        ("--punch-timeout",), "punch_timeout", VALUE, value=NUMBER, default=30.0,
        low=MIN_PUNCH_TIMEOUT, high=MAX_PUNCH_TIMEOUT, show_default=True, metavar="SECONDS",
        help="How long hole punching to one NATed provider may take (a failing punch waits "
        "it out; one that works takes a few round trips).",
    ),
    Option(
        ("--no-daemon",), "no_daemon", FLAG,
        help="Fetch with a node of this command's own even when a `blob serve` runs on the "
        "store.",
    ),
    # Global options too (p2p.cli.light's GLOBAL_ANYWHERE): the light path reads them there.
    Option(("--json",), "as_json", FLAG, shared="json_option"),
    Option(("--no-progress",), "no_progress", FLAG, help="No progress bar.", light=True),
    Option(("-v", "--verbose"), "verbose", COUNT, shared="verbose_option"),
)  # fmt: skip

BY_DEST: dict[str, Option] = {option.dest: option for option in GET_OPTIONS}
