"""A CLI worker killed in round 1 restarts with ``--resume`` and continues from its own
state: its AdamW moments, error-feedback residual and batch sampler from its store's
resume point (training.outer.trainer), its round from the run's tip. Two ``blob outer
worker`` processes over TCP on 127.0.0.1 with real stores; the survivor waits for it (the
quorum of a run of two is two). Before, the only way back was ``--join``: a fresh
trainer, its residual and moments lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from blobstore import Store
from identity import Attestation
from training.outer.agreement import decode_closure
from training.outer.launch import prepare_run, wait_for_addrs, worker_argv, worker_env
from training.outer.messages import ClosureAnnouncement, decode_message
from training.outer.params import RunParams
from training.outer.replay import decode_commitment
from training.outer.trainer import decode_resume, resume_tags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

# Bounds that only stop a hang: three worker starts import torch on a loaded machine.
STEP_TIMEOUT = 240.0


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    give_up = time.monotonic() + STEP_TIMEOUT
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < give_up, log.read_text(errors="replace")[-3000:]
        time.sleep(0.05)


# About 55 s on a loaded 2-vCPU machine: three worker starts, three short rounds.
@pytest.mark.timeout(3 * STEP_TIMEOUT)
def test_a_worker_killed_in_round_1_resumes_from_its_own_state(tmp_path: Path) -> None:
    params = RunParams(
        run_id="resume",
        workers=2,
        rounds=3,
        inner_steps=2,
        deadline=3.0,
        proposer_timeout=1.0,
        replay_rate=0.0,
    )
    plan = prepare_run(tmp_path / "run", params)
    w0, w1 = plan.workers
    extra = ["--start-timeout", "180", "--keep-states", "8"]
    logs = [w.dir / "log" for w in plan.workers]
    procs: list[subprocess.Popen[bytes]] = []

    def start(i: int, argv: list[str]) -> subprocess.Popen[bytes]:
        with logs[i].open("ab") as out:
            proc = subprocess.Popen(argv, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        first = start(0, worker_argv(plan, 0, extra=extra))
        addrs = wait_for_addrs(w0.addr_file, first, timeout=STEP_TIMEOUT)[:1]
        killed = start(1, worker_argv(plan, 1, bootstrap=addrs, extra=extra))
        wait_for_line(logs[1], "round 0 closed", killed)
        os.kill(killed.pid, signal.SIGKILL)  # in round 1: training, or waiting for it
        killed.wait()
        store = Store.open(w1.store)
        point = decode_resume(store.path(store.tags()[resume_tags("resume")[0]]).read_bytes())
        assert point.peer == w1.peer_id and point.round in (0, 1)
        argv = worker_argv(plan, 1, bootstrap=addrs, join=True, extra=[*extra, "--resume"])
        back = start(1, argv)
        assert back.wait(timeout=2 * STEP_TIMEOUT) == 0, logs[1].read_text()[-3000:]
        assert first.wait(timeout=STEP_TIMEOUT) == 0, logs[0].read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    r0, r1 = (json.loads(w.result.read_text()) for w in plan.workers)
    assert r0["final_root"] == r1["final_root"] and r0["agreed"] and r1["agreed"]
    assert r1["resumed"] == {"round": point.round, "inner": point.inner}
    assert f"resuming after round {point.round}: inner state {point.inner[:12]}" in (
        logs[1].read_text()
    )
    # Its next update is included, and was trained from its own inner state: the inner
    # state its commitment names is the one its resume point kept (a fresh trainer's
    # moments and residual would be another blob).
    later = [
        rec
        for rec in r0["rounds"]
        if rec["round"] > point.round and any(x["peer"] == w1.peer_id for x in rec["included"])
    ]
    assert later, r0["rounds"]
    store0 = Store.open(w0.store)
    message = decode_message(store0.path(later[0]["closure_blob"]).read_bytes())
    assert isinstance(message, ClosureAnnouncement)
    (entry,) = [x for x in decode_closure(message.body).included if x.peer == w1.peer_id]
    commitment_blob = Attestation.decode(entry.attestation).subjects[2]
    commitment = decode_commitment(Store.open(w1.store).path(commitment_blob).read_bytes())
    assert commitment.inner == point.inner
    assert commitment.round == later[0]["round"]
