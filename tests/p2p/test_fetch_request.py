"""A fetch's front door (p2p.node.request) and its one option table (p2p.fetch.options):
the reference parsed once, the options checked once, and the click command and the light
path's parser built from the same rows. In memory, no node."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from blobstore import BadBlobId, BlobNotFound
from p2p.blob.ticket import Ticket
from p2p.cli.get import check_table, get
from p2p.cli.light import parse
from p2p.fetch.options import FLAG, GET_OPTIONS, MAX_SEED_SECONDS, MULTI
from p2p.node.request import BadRequest, FetchOptions, FetchRequest, Reference

BLOB = "ab" * 32
ADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_a_reference_is_parsed_once_into_its_blob_and_ticket_peers() -> None:
    ticket = Ticket(BLOB, (ADDR,)).encode()
    parsed = Reference.parse(ticket)
    assert (parsed.blob_id, parsed.ticket_addrs) == (BLOB, (ADDR,))
    request = FetchRequest(parsed, FetchOptions(peers=("/ip4/10.0.0.1/tcp/1/p2p/x",)))
    assert request.providers == ("/ip4/10.0.0.1/tcp/1/p2p/x", ADDR)
    assert Reference.parse(BLOB) == Reference(BLOB, BLOB)
    with pytest.raises(BadBlobId):
        Reference.parse("weights")  # no store to know tags by


def test_an_unknown_tag_says_how_to_name_a_blob_that_is_elsewhere() -> None:
    def local(text: str) -> str:
        if text == "weights":
            return BLOB
        raise BlobNotFound(f"no blob or tag {text!r} in this store")

    assert Reference.parse("weights", local) == Reference("weights", BLOB)
    assert Reference.parse(BLOB, local).blob_id == BLOB
    with pytest.raises(BlobNotFound, match=r"no blob or tag 'other'.*full 64-hex ID or a ticket"):
        Reference.parse("other", local)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"upload_limit": 1.0, "no_upload": True}, "--upload-limit limits what --no-upload"),
        ({"seed_for": 5.0, "tensors": ("w",)}, "--seed-for serves what was fetched"),
        ({"tensors": ("w",), "include": ("*",)}, "--tensor takes a single safetensors blob"),
        ({"link": True}, "--link makes links at -o PATH"),
        ({"seed_for": MAX_SEED_SECONDS + 1}, "--seed-for must be at most 86400"),
        ({"punch_timeout": 0.5}, "--punch-timeout must be a number of at least 1"),
        ({"download_limit": 0.001}, "--download-limit must be a number of at least 0.26"),
        ({"upload_limit": float("inf")}, "--upload-limit must be a number"),
    ],
)
def test_options_are_checked_when_made(options: dict[str, object], message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        FetchOptions(**options)  # type: ignore[arg-type]
    assert caught.value.exit_code == 2


def test_options_that_fit_together_make_a_request(tmp_path: Path) -> None:
    options = FetchOptions(output=tmp_path / "out", link=True, seed_for=0, punch_timeout=300)
    assert not options.use_dht and options.own_node  # --seed-for needs a node of its own
    assert FetchOptions(bootstrap=("/ip4/1.2.3.4/tcp/1/p2p/x",)).use_dht
    assert not FetchOptions(bootstrap=("/ip4/1.2.3.4/tcp/1/p2p/x",), no_dht=True).use_dht


def test_the_click_command_is_the_option_table() -> None:
    from p2p.cli.app import add_global_options

    add_global_options(get)  # as the app does, idempotent: --store and --key, in no keyword
    check_table(get, GET_OPTIONS)
    rows = list(GET_OPTIONS)
    at = next(i for i, o in enumerate(rows) if o.name == "--bootstrap")
    rows[at] = replace(rows[at], kind=FLAG)  # a shared decorator drifted from its row
    with pytest.raises(RuntimeError, match="bootstrap"):
        check_table(get, rows)
    with pytest.raises(RuntimeError, match="no_progress"):
        check_table(get, [o for o in GET_OPTIONS if o.dest != "no_progress"])


def test_the_light_path_takes_the_light_rows_as_click_does() -> None:
    light = [o for o in GET_OPTIONS if o.light]
    assert {o.name for o in light} >= {"--peer", "--bootstrap", "--no-progress", "--no-dht"}
    argv = ["get", BLOB]
    for option in light:
        argv += [option.name, "a", option.name, "b"] if option.kind == MULTI else [option.name]
    line = parse(argv)
    assert line is not None and line.args == [BLOB]
    for option in light:
        assert line.opts[option.name] == (["a", "b"] if option.kind == MULTI else True)
    assert parse(["get", BLOB, "--listen", ADDR]) is None  # not a light row: the full get's
