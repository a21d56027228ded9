"""Software TPMs for tests and benchmarks: Debian's swtpm, on a private 127.0.0.1 port.

:func:`running_swtpm` manufactures a TPM 2.0 (``swtpm_setup --create-ek-cert``: an RSA-2048
EK with a certificate from a local CA, ``swtpm_localca``, whose files live in the caller's
``ca_dir``), starts ``swtpm socket`` on two free consecutive ports (the swtpm TCTI speaks
commands on ``port`` and control on ``port + 1``) and stops it on the way out. The local
CA's certificates (:func:`local_ca_certificates`) are what a test authority trusts with
``--ek-ca``. :func:`missing_tools` says why this cannot run here, or None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from ._pytss import unavailable_reason

# swtpm_setup manufactures a TPM in about a second; a loaded machine may take several.
SETUP_TIMEOUT_S = 60
# swtpm listens within milliseconds of starting; ten seconds covers a loaded machine.
START_TIMEOUT_S = 10
_POLL_S = 0.01
TOOLS = ("swtpm", "swtpm_setup", "swtpm_localca")


@dataclasses.dataclass(frozen=True)
class Swtpm:
    """A running swtpm: its TCTI string and state directory."""

    tcti: str
    port: int
    state_dir: Path


def missing_tools() -> str | None:
    """Why swtpm-backed tests cannot run here (missing tools or tpm2-pytss), or None."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install swtpm swtpm-tools)"
    return unavailable_reason()


def local_ca_certificates(ca_dir: Path) -> list[Path]:
    """The local CA's root and issuing certificates (present after the first setup)."""
    return [ca_dir / "swtpm-localca-rootca-cert.pem", ca_dir / "issuercert.pem"]


def _write_configs(ca_dir: Path) -> Path:
    ca_dir.mkdir(parents=True, exist_ok=True)
    localca = ca_dir / "swtpm-localca.conf"
    localca.write_text(
        f"statedir = {ca_dir}\n"
        f"signingkey = {ca_dir}/signkey.pem\n"
        f"issuercert = {ca_dir}/issuercert.pem\n"
        f"certserial = {ca_dir}/certserial\n"
    )
    options = ca_dir / "swtpm-localca.options"
    options.write_text("--platform-manufacturer blobnet\n--platform-version 2.1\n")
    setup = ca_dir / "swtpm_setup.conf"
    setup.write_text(
        f"create_certs_tool = {shutil.which('swtpm_localca')}\n"
        f"create_certs_tool_config = {localca}\n"
        f"create_certs_tool_options = {options}\n"
        "active_pcr_banks = sha256\n"
    )
    return setup


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on 127.0.0.1 (as far as we can tell)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"swtpm exited with status {process.returncode} at start")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(_POLL_S)
    raise RuntimeError(f"swtpm did not listen on 127.0.0.1:{port} within {START_TIMEOUT_S} s")


def manufacture(state_dir: Path, ca_dir: Path) -> None:
    """A new TPM 2.0 state in ``state_dir`` with an EK certificate from ``ca_dir``'s CA."""
    state_dir.mkdir(parents=True, exist_ok=True)
    setup = _write_configs(ca_dir)
    subprocess.run(
        [
            "swtpm_setup",
            "--tpm2",
            "--tpmstate",
            str(state_dir),
            "--create-ek-cert",
            "--config",
            str(setup),
            "--overwrite",
        ],
        check=True,
        capture_output=True,
        timeout=SETUP_TIMEOUT_S,
    )


@contextlib.contextmanager
def running_swtpm(state_dir: Path, ca_dir: Path) -> Iterator[Swtpm]:
    """Manufacture (if ``state_dir`` is new) and run a swtpm; stopped on the way out."""
    if not any(state_dir.glob("tpm2-*")):
        manufacture(state_dir, ca_dir)
    port = _free_port_pair()
    process = subprocess.Popen(
        [
            "swtpm",
            "socket",
            "--tpm2",
            "--tpmstate",
            f"dir={state_dir}",
            "--server",
            f"type=tcp,port={port},bindaddr=127.0.0.1",
            "--ctrl",
            f"type=tcp,port={port + 1},bindaddr=127.0.0.1",
            "--flags",
            "not-need-init,startup-clear",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, process)
        yield Swtpm(tcti=f"swtpm:host=127.0.0.1,port={port}", port=port, state_dir=state_dir)
    finally:
        process.terminate()
        try:
            process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
