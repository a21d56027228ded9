"""The decentralised outer loop over real worker processes on 127.0.0.1 (real nodes, real
stores, TCP, floodsub). Each run's roots are also recomputed in this process from the
update blobs the hub included, so "every worker agrees" cannot pass vacuously."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from blobstore import Store
from identity import (
    AdmissionCertificate,
    Authority,
    MachineKey,
    SoftwareSigner,
    load_key_file,
    sign_attestation,
)
from p2p.node import open_node
from training.codec import encode
from training.outer import apply_round, decode_update, state_root
from training.outer_messages import UPDATE_KIND, UpdateAnnouncement, encode_message, topic
from training.outer_net import (
    RunParams,
    RunPlan,
    prepare_run,
    worker_argv,
    worker_env,
)
from training.state_blob import decode_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def recompute(result: dict[str, Any], store: Store, params: RunParams) -> list[str]:
    """Replay a worker's rounds from its start state and the update blobs it included."""
    state = decode_state(store.path(result["start_state_blob"]).read_bytes())
    roots = []
    for rec in result["rounds"]:
        assert state_root(state) == rec["start_root"]
        updates = {
            x["peer"]: decode_update(store.path(x["blob"]).read_bytes(), state)
            for x in rec["included"]
        }
        state = apply_round(state, updates, params.outer_config())
        roots.append(state_root(state))
    return roots


def test_three_workers_two_rounds_reach_the_same_state(tmp_path: Path) -> None:
    work = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2p.cli",
            "--store",
            str(tmp_path / "unused"),
            "outer",
            "run",
            "--workers",
            "3",
            "--rounds",
            "2",
            "--inner-steps",
            "2",
            "--deadline",
            "10",
            "--workdir",
            str(work),
            "--timeout",
            "200",
            "--json",
        ],
        capture_output=True,
        timeout=230,
        env=worker_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"DISAGREE" not in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["finished"] == 3
    assert summary["roots_agree"]
    results = summary["results"]
    peers = {r["peer_id"] for r in results}
    assert len(peers) == 3
    assert len({r["operator"] for r in results}) == 3
    for result in results:
        assert result["agreed"]
        assert result["final_root"] == summary["final_root"]
        assert [rec["round"] for rec in result["rounds"]] == [0, 1]
        for rec in result["rounds"]:
            assert {x["peer"] for x in rec["included"]} == peers
            assert rec["closed_by"] == "all"
            assert rec["rejected"] == []
        # Every worker heard the others' final roots, and they were ours.
        assert set(result["final_roots_heard"]) == peers - {result["peer_id"]}
    # The same state has the same canonical blob on every worker.
    for r in range(2):
        assert len({res["rounds"][r]["state_blob"] for res in results}) == 1

    hub = results[0]
    params = RunParams(**hub["params"])
    store = Store.open(work / "worker-0" / "store")
    assert recompute(hub, store, params) == [rec["root"] for rec in hub["rounds"]]
    final = decode_state(store.path(hub["rounds"][-1]["state_blob"]).read_bytes())
    assert final.round == 2
    assert state_root(final) == summary["final_root"]
    # The compressed update is far smaller than a dense float32 pseudo-gradient.
    dense = 4 * sum(v.size for v in final.params.values())
    assert max(summary["rounds"][0]["update_bytes"]) * 50 < dense


# --- dropout, late join and forged updates, in one run ---------------------------------


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=worker_env())


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    while text not in _read(log):
        assert proc.poll() is None, f"worker exited early:\n{_read(log)[-3000:]}"
        await trio.sleep(0.1)


async def _wait_exit(procs: list[subprocess.Popen[bytes]]) -> None:
    while True:
        if all(proc.poll() is not None for proc in procs):
            return
        await trio.sleep(0.2)


def _forged_updates(plan: RunPlan, forger: MachineKey, blob: str) -> dict[str, bytes]:
    """Round-0 updates that must all be ignored: no certificate, a certificate from
    another authority, and an admitted key's attestation with a broken signature."""
    now = int(time.time())
    signer = SoftwareSigner(forger)
    run_authority = Authority(SoftwareSigner(load_key_file(plan.workdir / "authority.key")))
    rogue = Authority(SoftwareSigner(MachineKey.generate()))

    def cert(authority: Authority) -> AdmissionCertificate:
        return authority.admit(
            forger.peer_id,
            operator="forger",
            kernel_class=plan.kernel_class,
            not_before=now - 300,
            not_after=now + 3600,
            serial=99,
        )

    def attest(certificate: AdmissionCertificate | None) -> Any:
        return sign_attestation(
            signer,
            kind=UPDATE_KIND,
            digest=bytes.fromhex(blob),
            kernel_class=plan.kernel_class,
            subjects=[blob, plan.initial_root],
            time=now,
            certificate=certificate,
        )

    admitted = attest(cert(run_authority))
    broken = bytearray(admitted.signature)
    broken[5] ^= 0x40
    attestations = {
        "missing certificate": attest(None),
        "unknown authority": attest(cert(rogue)),
        "bad signature": dataclasses.replace(admitted, signature=bytes(broken)),
    }
    return {
        reason: encode_message(
            UpdateAnnouncement(plan.params.run_id, 0, blob, attestation.encode(), ())
        )
        for reason, attestation in attestations.items()
    }


@pytest.mark.timeout(300)
async def test_dropout_late_joiner_and_forged_updates(tmp_path: Path) -> None:
    """Worker 2 is SIGKILLed in round 1 (stalled before training): the others close that
    round at the deadline without it and agree. A worker started with --join adopts the
    state at the next round boundary and is included from then on, with the same roots.
    A forger's round-0 updates (no certificate, another authority's certificate, a broken
    signature) are rejected by every worker with that reason, and never included."""
    params = RunParams(run_id="faults", workers=3, rounds=5, inner_steps=2, deadline=6.0)
    plan = prepare_run(tmp_path / "run", params, slots=4)
    initial = decode_state(Store.open(plan.workers[0].store).path(plan.initial).read_bytes())
    # A well-formed update (it would change the state a lot if it were ever applied).
    rng = np.random.default_rng(7)
    poison = encode(
        {
            n: rng.standard_normal(v.shape).astype(np.float32) * 100
            for n, v in initial.params.items()
        },
        params.codec(),
    )
    logs = [tmp_path / f"worker-{i}.log" for i in range(4)]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    forger_key = MachineKey.generate()
    try:
        procs[0] = _spawn(worker_argv(plan, 0), logs[0])
        with trio.fail_after(120):
            while not plan.workers[0].addr_file.exists():
                assert procs[0].poll() is None, _read(logs[0])
                await trio.sleep(0.1)
        hub = json.loads(plan.workers[0].addr_file.read_text())["addrs"]
        async with open_node(
            tmp_path / "forger", key=forger_key, dht=False, pubsub=True, bootstrap=hub
        ) as forger:
            await forger.subscribe(topic(params.run_id))
            blob = await forger.add_bytes(poison)
            forged = _forged_updates(plan, forger_key, blob)

            async def forge() -> None:
                while True:
                    for data in forged.values():
                        await forger.publish(topic(params.run_id), data)
                    await trio.sleep(0.5)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(forge)
                procs[1] = _spawn(worker_argv(plan, 1, bootstrap=hub), logs[1])
                procs[2] = _spawn(
                    worker_argv(plan, 2, bootstrap=hub, extra=["--stall-round", "1"]), logs[2]
                )
                # Started now, it joins at the first round boundary after it hears a state.
                procs[3] = _spawn(worker_argv(plan, 3, bootstrap=hub, join=True), logs[3])
                with trio.fail_after(150):
                    await _wait_for_line(logs[2], "round 1: stalling", procs[2])
                procs[2].kill()
                with trio.fail_after(150):
                    await _wait_exit([procs[i] for i in (0, 1, 3)])
                nursery.cancel_scope.cancel()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i in (0, 1, 3):
        assert procs[i].returncode == 0, _read(logs[i])[-4000:]
        assert "DISAGREE" not in _read(logs[i])
    results = [json.loads(plan.workers[i].result.read_text()) for i in (0, 1, 3)]
    w0, w1, joiner = results
    p = [w.peer_id for w in plan.workers]
    assert {r["peer_id"] for r in results} == {p[0], p[1], p[3]}
    assert len({r["final_root"] for r in results}) == 1
    assert all(r["agreed"] and not r["disagreements"] for r in results)

    for w in (w0, w1):
        rounds = w["rounds"]
        assert [rec["round"] for rec in rounds] == [0, 1, 2, 3, 4]
        # Round 0: all three honest workers; the forger's three updates rejected.
        assert {x["peer"] for x in rounds[0]["included"]} == {p[0], p[1], p[2]}
        reasons = {x["reason"] for x in rounds[0]["rejected"] if x["peer"] == forger_key.peer_id}
        assert reasons == {"missing certificate", "unknown authority", "bad signature"}
        assert all(x["peer"] != forger_key.peer_id for rec in rounds for x in rec["included"])
        # Round 1: worker 2 was killed before sending; the round closed at the deadline.
        assert {x["peer"] for x in rounds[1]["included"]} == {p[0], p[1]}
        assert rounds[1]["closed_by"] == "deadline"

    joined = joiner["joined_at"]
    assert joined is not None and 2 <= joined <= 4, _read(logs[3])[-3000:]
    assert joiner["start_state_blob"] == w0["rounds"][joined - 1]["state_blob"]
    assert [rec["round"] for rec in joiner["rounds"]] == list(range(joined, 5))
    for rec in w0["rounds"][joined:]:
        assert {x["peer"] for x in rec["included"]} == {p[0], p[1], p[3]}
        assert rec["closed_by"] == "all"
    assert [r["root"] for r in joiner["rounds"]] == [r["root"] for r in w0["rounds"][joined:]]

    # The agreed roots are what this process computes from the included blobs.
    for result, index in ((w0, 0), (joiner, 3)):
        store = Store.open(plan.workers[index].store)
        assert recompute(result, store, params) == [rec["root"] for rec in result["rounds"]]
    assert w0["initial_root"] == state_root(initial) == plan.initial_root
