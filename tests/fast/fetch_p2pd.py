"""Fetch go-libp2p's daemon (p2pd) for the interop tests: `python tests/fast/fetch_p2pd.py`.

The binary ships inside the hivemind 1.1.12 wheel on PyPI (`hivemind/hivemind_cli/p2pd`, a
static x86-64 build of learning-at-home's go-libp2p-daemon). This downloads the wheel with pip
(no dependencies), checks the binary's SHA-256, and installs it as `.cache/p2pd/p2pd` under the
repository root. It does nothing when a good copy is already there.

Exit status: 0 when the binary is in place; 1 when it could not be fetched (with --optional,
0 and a warning instead, so an offline `make install` still succeeds: the interop tests then
skip and say why).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "hivemind==1.1.12"
MEMBER = "hivemind/hivemind_cli/p2pd"
# SHA-256 of p2pd inside hivemind-1.1.12-py3-none-manylinux2014_x86_64.whl.
P2PD_SHA256 = "42f8f48e62583b97cdba3c31439c08029fb2b9fc506b5bdd82c46b7cc1d279d8"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO_ROOT / ".cache" / "p2pd" / "p2pd"
# pip may need a while on a slow mirror; the wheel is about 9.5 MB.
PIP_TIMEOUT_S = 600


class FetchError(Exception):
    """The binary could not be downloaded or did not match."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_installed(dest: Path) -> bool:
    return dest.is_file() and os.access(dest, os.X_OK) and sha256_of(dest) == P2PD_SHA256


def fetch(dest: Path) -> Path:
    """Install p2pd at `dest` unless a good copy is there; return `dest`."""
    if is_installed(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="p2pd-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        try:
            subprocess.run(
                [*cmd, WHEEL_REQUIREMENT], check=True, timeout=PIP_TIMEOUT_S, capture_output=True
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            detail = getattr(err, "stderr", b"") or b""
            raise FetchError(
                f"pip could not download {WHEEL_REQUIREMENT}: {detail.decode(errors='replace')}"
            ) from err
        wheels = sorted(Path(tmp).glob("hivemind-*.whl"))
        if not wheels:
            raise FetchError(f"pip downloaded no hivemind wheel into {tmp}")
        part = dest.with_name(dest.name + ".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, part.open("wb") as out:
            while block := src.read(1 << 20):
                out.write(block)
        got = sha256_of(part)
        if got != P2PD_SHA256:
            part.unlink()
            raise FetchError(f"p2pd in the wheel has SHA-256 {got}, expected {P2PD_SHA256}")
        part.chmod(0o755)
        os.replace(part, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="where to put p2pd")
    parser.add_argument(
        "--optional", action="store_true", help="exit 0 with a warning if it cannot be fetched"
    )
    args = parser.parse_args(argv)
    try:
        path = fetch(args.dest)
    except (FetchError, OSError, zipfile.BadZipFile, KeyError) as err:
        print(f"fetch_p2pd: {err}", file=sys.stderr)
        if args.optional:
            print("fetch_p2pd: go interop tests will skip", file=sys.stderr)
            return 0
        return 1
    print(f"p2pd ready at {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
