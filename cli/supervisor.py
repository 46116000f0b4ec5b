"""`pdserve up`'s supervisor: a process that dies is started again, the rest keep serving.

    exits ─▶ log it (name, exit code) ─▶ wait the backoff ─▶ start it again, same argv and
             port (the router's poller finds a worker again; workers find the kvstore again)
             ─▶ log when its health says SERVING again

The backoff doubles with each failure in a row, up to a cap; a process that ran for
`fast_failure_s` before it died starts a fresh count. After `max_fast_failures` fast
failures in a row it is left down, loudly: it would only crash again (a bad flag, a port
taken by someone else). Only Ctrl-C/SIGTERM of `pdserve up` itself stops everything.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Protocol, TextIO

from pdserve.engine.process_exit import describe_exit


class Supervised(Protocol):
    """What the supervisor needs of a platform (cli/launcher.py Platform, or a test's fake):
    its processes by name, a way to start one again as planned, and whether one serves.
    A protocol rather than Platform itself, so the launcher, which starts a supervisor,
    stays the only one of the two that imports the other."""
    procs: dict[str, subprocess.Popen]

    def restart(self, name: str) -> subprocess.Popen: ...

    def serving(self, name: str) -> bool: ...


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    fast_failure_s: float = 60.0   # dying sooner than this after its start is a fast failure
    max_fast_failures: int = 5     # in a row: then the process is left down

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("initial_backoff_s: must be > 0 and <= max_backoff_s")
        if self.multiplier < 1 or self.max_fast_failures < 1:
            raise ValueError("multiplier must be >= 1 and max_fast_failures >= 1")

    def backoff_s(self, num_failures: int) -> float:
        """The wait before restart number `num_failures` of a run of failures (1, 2, ...)."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (num_failures - 1))


@dataclass
class _State:
    started: float
    num_failures: int = 0           # fast failures in a row
    restart_at: float | None = None
    gave_up: bool = False
    num_restarts: int = 0


class Supervisor:
    def __init__(self, platform: Supervised, policy: RestartPolicy = RestartPolicy(), out: TextIO = sys.stderr,
                 clock=time.monotonic):
        self.platform, self.policy, self.out, self._clock = platform, policy, out, clock
        now = clock()
        started = getattr(platform, "started", {})  # the platform's own start times, when it keeps them
        self._states = {name: _State(started.get(name, now)) for name in platform.procs}

    @property
    def gave_up(self) -> list[str]:
        return [name for name, state in self._states.items() if state.gave_up]

    def num_restarts(self, name: str) -> int:
        return self._states[name].num_restarts

    def watch(self, name: str) -> None:
        """Supervise a process started after this supervisor (a worker the autoscaler added)."""
        self._states[name] = _State(self._clock())

    def forget(self, name: str) -> None:
        """Stop supervising `name`: it is being stopped on purpose (drained), not dying."""
        self._states.pop(name, None)

    def tick(self) -> None:
        """Notice deaths, start what is due. Call it every few hundred ms."""
        now = self._clock()
        for name, state in self._states.items():
            if state.gave_up:
                continue
            if state.restart_at is not None:
                if now >= state.restart_at:
                    self._restart(name, state, now)
                continue
            code = self.platform.procs[name].poll()
            if code is not None:
                self._exited(name, state, code, now)

    def _exited(self, name: str, state: _State, code: int, now: float) -> None:
        ran_s = now - state.started
        state.num_failures = state.num_failures + 1 if ran_s < self.policy.fast_failure_s else 1
        if state.num_failures > self.policy.max_fast_failures:
            state.gave_up = True
            self._log(f"ERROR: {name} exited ({describe_exit(code)}) after {ran_s:.1f} s: "
                      f"{state.num_failures} failures in a row, each within {self.policy.fast_failure_s:g} s "
                      f"of its start. GIVING UP on {name}: it stays down (see its log above); "
                      f"the rest keep serving. Fix it, then restart pdserve up.")
            return
        delay = self.policy.backoff_s(state.num_failures)
        state.restart_at = now + delay
        self._log(f"{name} exited ({describe_exit(code)}) after {ran_s:.1f} s; restarting it in {delay:g} s "
                  f"(failure {state.num_failures} of {self.policy.max_fast_failures} in a row)")

    def _restart(self, name: str, state: _State, now: float) -> None:
        state.restart_at, state.started = None, now
        state.num_restarts += 1
        proc = self.platform.restart(name)
        self._log(f"restarted {name} (pid {proc.pid}, restart {state.num_restarts})")
        threading.Thread(target=self._announce_serving, args=(name, proc, now), daemon=True).start()

    def _announce_serving(self, name: str, proc, started: float) -> None:
        """Logs when the restarted process serves again (nothing if it dies first)."""
        while proc.poll() is None and self.platform.procs.get(name) is proc:
            if self.platform.serving(name):
                self._log(f"{name} serving again ({self._clock() - started:.1f} s after its restart)")
                return
            time.sleep(0.2)

    def _log(self, message: str) -> None:
        print(f"pdserve up: {message}", file=self.out, flush=True)

