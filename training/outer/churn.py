"""Churn on a local run: pause a worker past the deadline, kill one, start a late joiner.

``churn_run`` starts K worker processes: worker 0 first, then the others at once, each
bootstrapping to worker 0 only (they find each other through the run's announcements;
starting them one after another cost seconds of torch import each). Then, driven by the
workers' own log lines (never by sleeps guessed to fit a machine's speed), it kills
worker ``kill`` once it has closed round ``kill_after``; stops worker ``pause`` (SIGSTOP)
once it has closed round ``pause_after`` and resumes it after ``pause_s`` seconds or,
with ``resume_when = (worker, round)``, once that worker has also closed that round (so
a test knows rounds were closed while it was away, however slow the machine) or, with
``resume_after_others``, once every other worker has exited (it was left behind); starts
the joiner slot (``--join``) right after the K workers, so it joins at whatever round they
have reached when it is ready. It returns every worker's exit status and result, and
whether the honest survivors agree (no fork). The churn test
(tests/training/test_outer_net.py) and ``bench/outer.py --churn`` use it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.outer.launch import RunPlan, wait_for_addrs, worker_argv, worker_env

# Every step of a churn run is bounded: a worker that never logs what we wait for fails
# the run instead of hanging it.
STEP_TIMEOUT = 240.0


@dataclass
class ChurnPlan:
    pause: int | None = None
    pause_after: int = 0  # round whose closure the paused worker has applied first
    pause_s: float = 0.0
    resume_when: tuple[int, int] | None = None  # (worker, round): resume once it closed
    resume_after_others: bool = False  # resume once every other worker has exited
    kill: int | None = None
    kill_after: int = 0
    join: bool = False
    extra: dict[int, list[str]] = field(default_factory=dict)  # worker -> extra argv


@dataclass
class ChurnResult:
    returncodes: dict[int, int | None]
    results: dict[int, dict[str, Any] | None]
    logs: dict[int, Path]
    events: list[str]

    def honest(self, plan: ChurnPlan) -> list[int]:
        return sorted(i for i in self.returncodes if i != plan.kill)

    def final_roots(self, plan: ChurnPlan) -> set[str]:
        return {
            r["final_root"] for i in self.honest(plan) if (r := self.results.get(i)) is not None
        }

    def forked(self, plan: ChurnPlan) -> bool:
        return len(self.final_roots(plan)) != 1

    def all_exit_zero(self, plan: ChurnPlan) -> bool:
        return all(self.returncodes[i] == 0 for i in self.honest(plan))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_line(log: Path, text: str, proc: subprocess.Popen[bytes], give_up: float) -> None:
    while text not in _read(log):
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited ({proc.returncode}) before logging {text!r}")
        if time.monotonic() > give_up:
            raise TimeoutError(f"no {text!r} in {log} within the bound")
        time.sleep(0.1)


def churn_run(
    plan: RunPlan,
    churn: ChurnPlan,
    *,
    timeout: float,
    place: Callable[[int, list[str]], list[str]] | None = None,
) -> ChurnResult:
    """Run the plan's K workers (and a joiner in slot K, if asked) through ``churn``.
    ``place(i, argv)`` may rewrite worker i's command line (to run it on a WAN testbed
    host: ``ip netns exec ...`` in front, a ``--listen`` on the host's address)."""
    env = worker_env()
    k = plan.params.workers
    logs = {i: plan.workdir / f"worker-{i}.log" for i in range(k + 1)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    events: list[str] = []
    give_up = time.monotonic() + timeout

    def spawn(i: int, bootstrap: list[str], join: bool = False) -> subprocess.Popen[bytes]:
        argv = worker_argv(plan, i, bootstrap=bootstrap, join=join, extra=churn.extra.get(i, []))
        if place is not None:
            argv = place(i, argv)
        with logs[i].open("wb") as f:
            return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)

    try:
        procs[0] = spawn(0, [])
        addrs = wait_for_addrs(plan.workers[0].addr_file, procs[0], 120)[:1]
        for i in range(1, k):
            procs[i] = spawn(i, addrs)
        for i in range(1, k):
            addrs = addrs + wait_for_addrs(plan.workers[i].addr_file, procs[i], 120)[:1]
        if churn.join:
            # Started now, it takes torch's import time to be ready and joins at whatever
            # round the others have reached by then (never in the start barrier).
            procs[k] = spawn(k, addrs, join=True)
            events.append(f"started joiner {k}")
        steps: list[tuple[int, int, str]] = []
        if churn.kill is not None:
            steps.append((churn.kill_after, churn.kill, "kill"))
        if churn.pause is not None:
            steps.append((churn.pause_after, churn.pause, "pause"))
        for after, who, what in sorted(steps):
            bound = min(give_up, time.monotonic() + STEP_TIMEOUT)
            _wait_line(logs[who], f"round {after} closed", procs[who], bound)
            if what == "kill":
                procs[who].kill()
                procs[who].wait()
                events.append(f"killed worker {who} after round {after}")
            else:
                os.kill(procs[who].pid, signal.SIGSTOP)
                stopped = time.monotonic()
                events.append(f"paused worker {who} after round {after}")
                time.sleep(churn.pause_s)
                if churn.resume_when is not None:
                    other, closed = churn.resume_when
                    bound = min(give_up, time.monotonic() + STEP_TIMEOUT)
                    _wait_line(logs[other], f"round {closed} closed", procs[other], bound)
                if churn.resume_after_others:
                    bound = min(give_up, time.monotonic() + STEP_TIMEOUT)
                    for i in procs:
                        if i != who:
                            procs[i].wait(timeout=max(1.0, bound - time.monotonic()))
                os.kill(procs[who].pid, signal.SIGCONT)
                events.append(f"resumed worker {who} after {time.monotonic() - stopped:.1f}s")
        for proc in procs.values():
            try:
                proc.wait(timeout=max(1.0, give_up - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    results: dict[int, dict[str, Any] | None] = {}
    for i, proc in procs.items():
        path = plan.workers[i].result
        results[i] = (
            json.loads(path.read_text()) if proc.returncode == 0 and path.exists() else None
        )
    return ChurnResult({i: p.returncode for i, p in procs.items()}, results, logs, events)
