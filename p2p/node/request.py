"""A fetch's front door: what to fetch (a :class:`Reference`, parsed once) and how (its
:class:`FetchOptions`, checked once), together a :class:`FetchRequest`. ``blob get``
builds one and hands it to the node (``Fetches.fetch`` takes a Reference as it is) or to
the daemon serving the store; neither parses the reference again.

Rules
1. A reference is a ticket (``blob1...``: its blob ID and its peers' addresses), a 64-hex
   blob ID, a tag or 8+ character ID prefix the store knows (given ``local``), or a
   published ``PUBLISHER/NAME`` once resolved (:meth:`Reference.named`). ``parse`` is the
   only reader of reference text.
2. Options are checked in FetchOptions' constructor, in the order ``blob get`` checks
   them: a combination that makes no sense (--upload-limit with --no-upload, --seed-for
   with --tensor...) or a number out of the bounds the option table
   (p2p.fetch.options) gives is a :class:`BadRequest`, a usage error (exit 2) that names
   the option. The click command checks the same bounds first, from the same table.
3. Options are checked before the reference is read: a bad command line fails before
   the store is opened or a name is asked after on the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from blobstore import BadBlobId, BlobNotFound, parse_blob_id
from blobstore.catalog import check_tag_name
from blobstore.exitcodes import ExitCode
from blobstore.export import check_output
from p2p.blob.pacing import MIN_UPLOAD_LIMIT
from p2p.blob.ticket import Ticket
from p2p.errors import P2PError
from p2p.fetch.options import BY_DEST, RATE


class BadRequest(P2PError):
    """Options that do not fit together, or a value out of its option's bounds."""

    exit_code = ExitCode.USAGE


@dataclass(frozen=True)
class Reference:
    """What to fetch: ``text`` as given, the ``blob_id`` it names, a ticket's peers'
    addresses (``ticket_addrs``), and the published name it was resolved from, if any."""

    text: str
    blob_id: str
    ticket_addrs: tuple[str, ...] = ()
    name: str | None = None

    @classmethod
    def parse(cls, text: str, local: Callable[[str], str] | None = None) -> Reference:
        """A ticket or blob ID; with ``local`` (``Store.resolve``) a tag or ID prefix too.
        Raises BadTicket, BadBlobId, or BlobNotFound (an unknown tag or prefix, saying how
        to name a blob that is elsewhere)."""
        if text.startswith("blob1"):
            ticket = Ticket.decode(text)
            return cls(text, ticket.blob_id, tuple(ticket.addrs))
        if local is None:
            return cls(text, parse_blob_id(text))
        try:
            return cls(text, local(text))
        except BlobNotFound as exc:
            here = exc  # says why (a prefix too short, no such tag)
        try:
            return cls(text, parse_blob_id(text))
        except BadBlobId:
            raise BlobNotFound(
                f"{here}; to fetch it from elsewhere, give its full 64-hex ID or a ticket"
            ) from None

    @classmethod
    def named(cls, text: str, blob_id: str) -> Reference:
        """``PUBLISHER/NAME`` (``text``), resolved to ``blob_id``."""
        return cls(text, blob_id, name=text)

    @classmethod
    def of(cls, blob_id: str) -> Reference:
        """A blob ID the caller holds already checked (a collection's child, from its
        verified manifest)."""
        return cls(blob_id, blob_id)


def _check_bounds(dest: str, value: float | None) -> None:
    """``value`` within the option table's bounds for ``dest`` (rule 2)."""
    if value is None:
        return
    option = BY_DEST[dest]
    low = MIN_UPLOAD_LIMIT / 1e6 if option.value == RATE else option.low
    if (option.value == RATE and not math.isfinite(value)) or (low is not None and value < low):
        raise BadRequest(f"{option.name} must be a number of at least {low:g}")
    if option.high is not None and value > option.high:
        raise BadRequest(f"{option.name} must be at most {option.high:g}")


@dataclass(frozen=True)
class FetchOptions:
    """How ``blob get`` fetches (the option table, p2p.fetch.options, says what each
    means), checked once when made (rules 2 and 3). Rates are in MB/s, as typed."""

    peers: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    listen: tuple[str, ...] = ()
    no_dht: bool = False
    output: Path | None = None
    into_dir: bool = False  # -o PATH/: a directory, even for a one-file blob
    force: bool = False
    tag_name: str | None = None
    include: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()
    link: bool = False
    discovery_timeout: float = 10.0
    no_upload: bool = False
    upload_limit: float | None = None
    download_limit: float | None = None
    seed_for: float | None = None
    via_relay: bool = False
    certificate: bytes | None = None
    punch_timeout: float = 30.0
    no_daemon: bool = False
    as_json: bool = False
    no_progress: bool = False
    verbose: int = 0

    def __post_init__(self) -> None:
        if self.tag_name is not None:
            check_tag_name(self.tag_name)
        if self.upload_limit is not None and self.no_upload:
            raise BadRequest("--upload-limit limits what --no-upload switches off: give one")
        if self.seed_for is not None and (self.no_upload or self.tensors):
            raise BadRequest("--seed-for serves what was fetched: not with --no-upload or --tensor")
        if self.tensors and (self.include or self.link):
            raise BadRequest("--tensor takes a single safetensors blob: no --include or --link")
        if self.link and self.output is None:
            raise BadRequest("--link makes links at -o PATH: give -o")
        for dest in ("discovery_timeout", "upload_limit", "download_limit", "seed_for",
                     "punch_timeout"):  # fmt: skip
            _check_bounds(dest, getattr(self, dest))
        if self.output is not None:
            check_output(self.output)

    @property
    def use_dht(self) -> bool:
        """Whether providers are looked for on the DHT: through --bootstrap peers."""
        return bool(self.bootstrap) and not self.no_dht

    @property
    def own_node(self) -> bool:
        """Whether the fetch needs a node of this command's own: what a `blob serve`'s
        fetch cannot do (--include, --seed-for, relays, a certificate, a download cap)."""
        return bool(
            self.no_daemon
            or self.include
            or self.seed_for is not None
            or self.via_relay
            or self.certificate
            or self.download_limit is not None
        )


@dataclass(frozen=True)
class FetchRequest:
    """One fetch: its reference, parsed once, and its options, checked once."""

    reference: Reference
    options: FetchOptions

    @property
    def blob_id(self) -> str:
        return self.reference.blob_id

    @property
    def providers(self) -> tuple[str, ...]:
        """The peers named to fetch from: --peer's, then the ticket's."""
        return (*self.options.peers, *self.reference.ticket_addrs)
