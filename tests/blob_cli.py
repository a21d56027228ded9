"""Ways for tests to run ``blob`` besides a plain subprocess.

- :func:`blob_here`: through ``p2p.cli.main`` in this process, for commands that answer
  before any node starts (usage errors, local reads, keys and certificates), where a
  subprocess would only add an interpreter start.
- :func:`start_warm` / :func:`go`: a training command's own process, started before its
  command line is known. It pays the imports every training command pays (torch,
  transformers, peft: seconds each on a loaded machine) while the test prepares, then runs
  the one ``blob`` command line it reads from stdin, as ``blob`` would. It is a fresh
  interpreter (its own hash seed), not a fork.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence

_WARM = (
    "import json, sys\n"
    "import training.rounds.cli, training.rounds.round, training.rounds.trainer\n"  # torch, peft
    "from transformers import AutoModelForCausalLM  # noqa: F401 (loaded lazily otherwise)\n"
    "from p2p.cli import main\n"
    "main(json.loads(sys.stdin.readline()))\n"
)


def blob_here(argv: Sequence[str], code: int | None = None) -> subprocess.CompletedProcess[str]:
    """``blob ARGV`` in this process, exit status and streams captured; with ``code``, the
    exit status is asserted."""
    from click.testing import CliRunner

    from p2p.cli import main

    with CliRunner().isolation(env={"BLOBNET_PASSPHRASE": None}) as (out, err, _):
        try:
            main(list(argv))
            got: int = 0
        except SystemExit as exc:
            got = exc.code if isinstance(exc.code, int) else 1
        streams = [out.getvalue().decode(), err.getvalue().decode()]
    if code is not None:
        assert got == code, f"blob {' '.join(argv)} exited {got}, expected {code}:\n{streams}"
    return subprocess.CompletedProcess(list(argv), got, *streams)


def start_warm(env: Mapping[str, str]) -> subprocess.Popen[str]:
    """A training process importing what training commands need; :func:`go` starts it."""
    return subprocess.Popen(
        [sys.executable, "-c", _WARM],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env),
    )


def go(proc: subprocess.Popen[str], argv: Sequence[str]) -> None:
    """Give a warm process its ``blob`` command line (without the program name)."""
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(list(argv)) + "\n")
    proc.stdin.flush()
