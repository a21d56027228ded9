"""A `blob serve` process for a bench: started, its ready line read, stopped.

`blob serve --json` prints one line of JSON once it listens (its peer ID and ``addrs``);
a bench starts the process, waits for that line and dials what it names. Imported by the
benches next to this file (``sys.path`` holds their folder).
"""

from __future__ import annotations

import json
import select
import subprocess
from collections.abc import Callable
from typing import IO, Any

# An interpreter start and the libp2p import before the line, on a loaded 2-CPU machine.
READY_TIMEOUT = 60.0
# What SIGTERM is given to flush and close the store before SIGKILL.
STOP_TIMEOUT = 30.0


def start_serve(
    argv: list[str],
    *,
    stderr: int | IO[Any] = subprocess.DEVNULL,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = READY_TIMEOUT,
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start ``argv`` (a ``blob ... serve --json`` command line) and return the process
    and its ready line. SystemExit, the process killed, when no line comes within
    ``timeout`` or it exits first."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=preexec_fn
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        code = proc.wait()
        why = f"exited ({code})" if ready else f"printed nothing in {timeout:g} s"
        raise SystemExit(f"blob serve did not become ready: it {why}")
    info: dict[str, Any] = json.loads(line)
    return proc, info


def stop_serve(proc: subprocess.Popen[str], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
