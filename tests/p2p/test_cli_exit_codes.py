"""Every ``blob`` command, walked from the click tree, against the README's exit-code table.

Each command gets the mistakes it can be given: a missing input file (exit 3), a
malformed address (2), a value its option's type refuses (2), an option it does not have
(2). Each answer must be the table's code and one line on stderr, ``blob: error: ...`` (or
``blob CMD: error: ...`` for a usage error), naming what was wrong; never click's
``Error:``, never a traceback. A command added to the tree is walked with the rest: its
path and address options are found by their type and name, and the test fails until
:data:`VALID` says how to call it (so that each probe has one mistake only).

Every group's, command's and option's help is plain text as well (no reST markup).

Commands run in this process (``tests.blob_cli.blob_here``): every probe is refused before
a node listens or a worker or a training step starts (a node given a malformed listen
address stops at parsing it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from tests.blob_cli import blob_here

README = Path(__file__).resolve().parents[2] / "README.md"
ONE_ERROR_LINE = re.compile(r"^blob(?: [a-z][\w-]*)*: error: \S")

# Path parameters that a command writes or creates, not reads: no "missing file" for them.
# (--store and --key, here or after the command, are created on first use.)
OUTPUTS = {
    "store",
    "key",
    "output",
    "dest",
    "workdir",
    "result_path",
    "addr_file",
    "registry_path",
    "store_root",
    "key_path",
}
# ... and per command, where the same name is an input elsewhere.
OUTPUTS_OF = {("tpm", "admit"): {"revoked_path"}}  # the list a replaced serial is appended to
# Text parameters that name an input file (a .pub file or 64 hex digits; a model directory).
FILE_TEXT = {"authorities", "model_ref"}
# Options that take a peer's or a listener's address, and a malformed value of each kind.
MULTIADDR_OPTIONS = {"--listen", "--peer", "--bootstrap", "--relay", "--addr"}
HOST_PORT_OPTIONS = {"--metrics", "--api-listen"}
MALFORMED_MULTIADDR = "127.0.0.1:4999"
MALFORMED_HOST_PORT = "127.0.0.1:port"
# Types whose values click checks: every one refuses this.
NONSENSE = "nonsense"


def _exit_codes() -> dict[str, int]:
    """The README's exit-code table: the code of each kind of mistake probed here."""
    rows = dict(
        (m.group(2).lower(), int(m.group(1)))
        for m in re.finditer(r"^\| (\d+) \| (.+) \|$", README.read_text(), re.MULTILINE)
    )

    def code_of(words: str) -> int:
        (code,) = {code for meaning, code in rows.items() if words in meaning}
        return code

    return {
        "missing file": code_of("missing file"),
        "malformed address": code_of("a malformed address"),
        "bad value": code_of("bad option or argument"),
    }


CODES = _exit_codes()


@dataclass
class World:
    tmp: Path
    key: Path
    peer: str
    auth_key: Path
    auth_pub: Path
    cert: Path
    attestation: Path
    blob: str
    file: Path
    recipe: Path

    def run(self, argv: list[str]) -> tuple[int, str]:
        done = blob_here(["--store", str(self.tmp / "store"), "--key", str(self.key), *argv])
        return done.returncode, done.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    tmp = tmp_path_factory.mktemp("exit-codes")
    key, store = tmp / "machine.key", tmp / "store"
    base = ["--store", str(store), "--key", str(key)]
    peer = json.loads(blob_here([*base, "id", "--json"], code=0).stdout)["peer_id"]
    auth = tmp / "auth.key"
    blob_here([*base, "authority", "new", "-o", str(auth)], code=0)
    cert = tmp / "machine.cert"
    admit = ["admit", peer, "--operator", "o", "--kernel-class", "k", "--authority", str(auth)]
    blob_here([*base, *admit, "-o", str(cert)], code=0)
    attestation = tmp / "a.att"
    sign = ["attest", "sign", "--kind", "reviewed", "--digest", "ab" * 32, "--kernel-class", "k"]
    blob_here([*base, *sign, "-o", str(attestation)], code=0)
    file = tmp / "data.bin"
    file.write_bytes(b"some bytes")
    put = blob_here([*base, "put", str(file), "--json"], code=0)
    recipe = tmp / "recipe.msgpack"
    blob_here([*base, "train", "recipe", "-o", str(recipe)], code=0)
    return World(
        tmp, key, peer, auth, tmp / "auth.key.pub", cert, attestation,
        json.loads(put.stdout)[0]["id"], file, recipe,
    )  # fmt: skip


def _valid(w: World) -> dict[str, dict[str, object]]:
    """A call of each command that is right but for the one mistake a probe makes:
    parameter name to value (True: a flag given). Probes never run these as they are."""
    out = str(w.tmp / "out")
    initial = "ab" * 32
    return {
        "admit": {"peer_id": w.peer, "operator": "o", "kernel_class": "k",
                  "authority_path": w.auth_key, "output": out},
        "attest sign": {"kind": "reviewed", "digest_hex": "ab" * 32, "kernel_class": "k",
                        "cert_path": w.cert, "output": out},
        "attest verify": {"file": w.attestation, "authorities": w.auth_pub},
        "authority new": {"output": out},
        "cat": {"ref": w.blob},
        "cert show": {"file": w.cert, "authorities": w.auth_pub},
        "catalog": {"publisher": w.peer, "peers": "/ip4/127.0.0.1/tcp/9/p2p/" + w.peer,
                    "authorities": w.auth_pub},
        "demo": {},
        "export": {"ref": w.blob, "dest": out},
        "gc": {"dry_run": True},
        "get": {"ref": w.blob},
        "id": {},
        "ls": {},
        "outer export": {"run_ref": "run", "output": out},
        "outer forget": {"run_id": "run", "dry_run": True},
        "outer init": {"model_ref": w.file, "run_id": "run", "authorities": w.auth_pub,
                       "workers": "1"},
        "outer levels": {"run_ref": "run"},
        "outer milestones": {"run_id": "run"},
        "outer run": {},
        "outer simulate": {},
        "outer verify": {"run_id": "run", "authorities": w.auth_pub},
        "outer worker": {"run_id": "run", "shard": "0", "workers": "1", "rounds": "1",
                         "authorities": w.auth_pub, "initial": initial, "cert_path": w.cert},
        "publish": {"name": "run/x", "ref": w.blob},
        "put": {"paths": w.file},
        "relay": {"authorities": w.auth_pub},
        "resolve": {"ref": f"{w.peer}/x", "authorities": w.auth_pub},
        "rm": {"refs": w.blob},
        "serve": {"no_dht": True},
        "share": {"path": w.file, "no_dht": True},
        "stat": {"ref": w.blob},
        "status": {},
        "store-mode": {},
        "tag": {"name": "t", "ref": w.blob},
        "ticket": {"ref": w.blob, "addrs": "/ip4/127.0.0.1/tcp/9/p2p/" + w.peer},
        "tpm admit": {"answer_path": w.file, "operator": "o", "kernel_class": "k",
                      "authority_path": w.auth_key, "registry_path": w.tmp / "reg",
                      "output": out},
        "tpm answer": {"challenge_path": w.file, "output": out},
        "tpm bind": {"output": out},
        "tpm challenge": {"evidence_path": w.file, "ek_ca_paths": w.file,
                          "authority_path": w.auth_key, "registry_path": w.tmp / "reg",
                          "output": out},
        "train check": {"round_ref": w.blob, "attestations": w.attestation,
                        "authorities": w.auth_pub},
        "train init-model": {"arch": "llama"},
        "train kernel-class": {},
        "train recipe": {"output": out},
        "train records": {"files": w.file, "seq_len": "8"},
        "train replay": {"round_ref": w.blob, "cert_path": w.cert},
        "train run": {"base_ref": w.blob, "records_ref": w.blob, "recipe_path": w.recipe,
                      "seed": "1", "device": "cpu", "cert_path": w.cert},
        "untag": {"name": "t"},
        "verify": {},
    }  # fmt: skip


def _commands() -> Iterator[tuple[tuple[str, ...], click.Command]]:
    from p2p.cli.app import cli

    def walk(
        group: click.Group, path: tuple[str, ...]
    ) -> Iterator[tuple[tuple[str, ...], click.Command]]:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            assert command is not None, f"blob {' '.join((*path, name))} does not load"
            if isinstance(command, click.Group):
                yield from walk(command, (*path, name))
            else:
                yield (*path, name), command

    yield from walk(cli, ())


@dataclass
class Probe:
    command: tuple[str, ...]
    mistake: str
    param: str
    value: str

    @property
    def id(self) -> str:
        return f"{' '.join(self.command)} {self.param}={self.value}"


def _probes(command: tuple[str, ...], cmd: click.Command, tmp: Path) -> Iterator[Probe]:
    yield Probe(command, "bad value", "--no-such-option", "")
    for param in cmd.params:
        name = param.name or ""
        if getattr(param, "hidden", False) or isinstance(param.type, click.types.BoolParamType):
            continue
        opts = set(param.opts)
        if name in FILE_TEXT or (
            isinstance(param.type, click.Path)
            and name not in OUTPUTS
            and name not in OUTPUTS_OF.get(command, set())
        ):
            yield Probe(command, "missing file", name, str(tmp / f"missing-{name}"))
        elif opts & MULTIADDR_OPTIONS:
            yield Probe(command, "malformed address", name, MALFORMED_MULTIADDR)
        elif opts & HOST_PORT_OPTIONS:
            yield Probe(command, "malformed address", name, MALFORMED_HOST_PORT)
        elif not isinstance(param.type, click.types.StringParamType | click.Path):
            yield Probe(command, "bad value", name, NONSENSE)


def _argv(cmd: click.Command, values: dict[str, object]) -> list[str]:
    args: list[str] = []
    for param in cmd.params:
        value = values.get(param.name or "")
        if value is None or value is False:
            continue
        if isinstance(param, click.Argument):
            args.append(str(value))
        elif value is True:
            args.append(param.opts[0])
        else:
            args += [param.opts[0], str(value)]
    return args


def test_every_command_answers_each_mistake_with_the_tables_code_and_one_line(
    world: World,
) -> None:
    """`serve --listen 127.0.0.1:4999` exited 4, `outer init --model ./nonexistent` 1 with
    click's `Error:`, `outer worker --cert /nonexistent` 1, `share /nonexistent` 2: each
    mistake of each command now gets the README's code and one `blob: error:` line that
    names what was wrong."""
    valid = _valid(world)
    wrong: list[str] = []
    probed = 0
    for command, cmd in _commands():
        key = " ".join(command)
        assert key in valid, f"say in _valid how to call `blob {key}` (one mistake per probe)"
        for probe in _probes(command, cmd, world.tmp):
            probed += 1
            argv = [*command]
            if probe.param == "--no-such-option":
                argv += [*_argv(cmd, valid[key]), "--no-such-option"]
            else:
                argv += _argv(cmd, {**valid[key], probe.param: probe.value})
            code, stderr = world.run(argv)
            lines = stderr.strip().splitlines()
            expected = CODES[probe.mistake]
            said = lines[0] if len(lines) == 1 else stderr
            if code != expected or len(lines) != 1 or not ONE_ERROR_LINE.match(lines[0]):
                wrong.append(f"{probe.id}: {probe.mistake}, exit {code} (not {expected}): {said}")
            elif probe.value and probe.value not in lines[0] and probe.param not in lines[0]:
                wrong.append(f"{probe.id}: the line does not say what was wrong: {said}")
    assert probed > 100
    assert not wrong, "\n".join(wrong)


# What reST and Sphinx write that a terminal shows as it is.
MARKUP = re.compile(r"``|:(?:func|mod|class|meth|attr|data):`")


def test_help_text_is_plain_text() -> None:
    """`blob status --help` and `blob outer forget --help` showed reST's ``double
    backticks`` (their docstrings are the help): every group's, command's and option's
    help is plain text."""
    from p2p.cli.app import cli

    marked: list[str] = []

    def walk(command: click.Command, path: str) -> None:
        texts = [command.help, command.short_help, command.epilog]
        texts += [getattr(param, "help", None) for param in command.params]
        marked.extend(f"{path}: {text!r:.120}" for text in texts if text and MARKUP.search(text))
        if isinstance(command, click.Group):
            ctx = click.Context(command)
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, f"{path} {name}")

    walk(cli, "blob")
    assert not marked, "\n".join(marked)
