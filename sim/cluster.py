"""The discrete-event loop: requests arrive from a trace, the router (sim/router.py: its
own policy code) chooses a path and workers, workers step (sim/worker.py), and the KV
hand-off costs what the profile says.

    arrival ─ path ─┬─ disaggregated: prefill pool ─ first token ─ hand-off (put + get) ─┐
                    └─ direct: decode worker prefills it itself ─────────────────────────┴─ decode pool streams

One event heap; a worker schedules its next step when the last one ends (continuous
batching: requests join and leave between steps). Workers placed on one host
(`workers_per_host`) slow each other down: while a neighbour steps, a step runs at the
profile's neighbour factor, and each start or end of a step on the host re-times the
others' (the part done so far kept, the rest at the new speed). The router sees each
worker as last polled plus its own in-flight counters; a request no unsaturated worker can take waits
in the pool's queue (FIFO) for at most its class's max_queue_ms, then is refused.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from pdserve.services.router.decide.config import RoutingConfig
from pdserve.services.router.decide.paths import DISAGGREGATED
from pdserve.services.router.decide.views import DECODE, PREFILL
from pdserve.sim.profile import Profile
from pdserve.sim.router import PromptTokens, SimRouter
from pdserve.sim.trace import TraceRequest
from pdserve.sim.worker import COLOCATED, DECODE_ONLY, PREFILL_ONLY, Seq, SimWorker


@dataclass(eq=False)
class SimRequest:
    index: int
    arrival_s: float
    num_prompt: int
    num_output: int
    hash_ids: tuple
    slo_class: str
    path: str = ""
    first_s: float | None = None   # first token's time (absolute)
    written_s: float = 0.0         # when the prefill's KV write ended (the decode's read waits for it)
    last_s: float | None = None
    end_s: float | None = None
    rejected: bool = False
    itls: list = field(default_factory=list)
    workers: list = field(default_factory=list)  # addresses it ran on, in order

    @property
    def prompt(self) -> PromptTokens:
        return PromptTokens(self.num_prompt, self.hash_ids, self.index)


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int
    num_decode: int
    router: RoutingConfig = RoutingConfig()
    slo_class: str = ""                 # "": the router's default class
    # workers per host, in order (prefill first): those on one host share its cores, cache
    # and memory bus (`pdserve up` on one machine: all of them); 1 where each has its own device
    workers_per_host: int = 1

    def __post_init__(self):
        if self.workers_per_host < 1:
            raise ValueError(f"--workers-per-host: must be >= 1, got {self.workers_per_host}")
        if self.num_prefill < 0:
            raise ValueError(f"--prefill: must be >= 0, got {self.num_prefill}")
        if self.num_decode < 1:
            raise ValueError(f"--decode: needs at least one worker, got {self.num_decode}")


@dataclass
class _RunningStep:
    plan: object           # the worker's StepPlan
    started_s: float
    left_s: float          # what is left of it, in seconds alone on the host
    factor: float          # how many times as long it runs at present
    since_s: float         # when left_s and factor were last set
    version: int = 0       # its end event's number: the events of earlier timings are stale


class Cluster:
    def __init__(self, cfg: ClusterConfig, profile: Profile):
        self.cfg, self.profile = cfg, profile
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count(1)  # event order; also the step-end versions (0: none yet)
        self.router = SimRouter(cfg.router, colocated=cfg.num_prefill == 0)
        self.workers: dict[str, SimWorker] = {}
        self.pool_of: dict[str, str] = {}
        self.host_of: dict[str, int] = {}
        self._hosts: dict[int, list[SimWorker]] = {}
        self._steps: dict[str, _RunningStep] = {}
        for pool, n in ((PREFILL, cfg.num_prefill), (DECODE, cfg.num_decode)):
            for i in range(n):
                self._add_worker(pool, f"{pool}-{i}")
        self._pending = {PREFILL: deque(), DECODE: deque()}
        self._open = 0  # requests not yet ended: the poller runs while there are any
        self._slo_class = cfg.slo_class or cfg.router.default_slo_class
        self._max_queue_s = cfg.router.slo_classes[self._slo_class].max_queue_ms / 1000

    def _add_worker(self, pool: str, address: str) -> None:
        worker = self.workers[address] = SimWorker(address, self.profile)
        self.pool_of[address] = pool
        self.host_of[address] = host = (len(self.workers) - 1) // self.cfg.workers_per_host
        self._hosts.setdefault(host, []).append(worker)
        self.router.set_workers(pool, [a for a, p in self.pool_of.items() if p == pool])

    # ---- the loop --------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run(self, trace: list[TraceRequest]) -> list[SimRequest]:
        requests = [SimRequest(i, r.arrival_s, r.input_length, r.output_length, r.hash_ids, self._slo_class)
                    for i, r in enumerate(trace)]
        for req in requests:
            self.at(req.arrival_s, self._arrive, req)
        self._open = len(requests)
        self._poll()
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        return requests

    def _poll(self) -> None:
        for address, worker in self.workers.items():
            self.router.report(self.pool_of[address], address, worker.load())
        self._retry_pending()
        if self._open:
            self.at(self.now + self.cfg.router.poll_interval_s, self._poll)

    # ---- the request flow ------------------------------------------------------------
    def _arrive(self, req: SimRequest) -> None:
        choice = self.router.choose_path(req.num_prompt, req.slo_class)
        req.path = choice.path
        if choice.path == DISAGGREGATED:
            self._acquire(PREFILL, req, req.num_prompt, self._start_prefill)
        else:
            self._acquire(DECODE, req, req.num_prompt,
                          lambda r, a, t: self._start_decode(r, a, t, COLOCATED, choice.prefill_chunk_tokens))

    def _acquire(self, pool: str, req: SimRequest, num_prefill_tokens: int, then) -> None:
        if self._pending[pool] or not self._try(pool, req, num_prefill_tokens, then):
            self._pending[pool].append((req, num_prefill_tokens, then, self.now + self._max_queue_s))

    def _try(self, pool: str, req: SimRequest, num_prefill_tokens: int, then) -> bool:
        slot = self.router.place(pool, req.prompt, num_prefill_tokens)
        if slot is None:
            return False
        then(req, *slot)
        return True

    def _retry_pending(self) -> None:
        for pool, queue in self._pending.items():
            while queue:
                req, n, then, deadline = queue[0]
                if self.now > deadline:  # RESOURCE_EXHAUSTED: refused with a retry hint
                    queue.popleft()
                    req.rejected = True
                    self._end(req)
                elif self._try(pool, req, n, then):
                    queue.popleft()
                else:
                    break

    def _start_prefill(self, req: SimRequest, address: str, tokens: int) -> None:
        seq = Seq(req, PREFILL_ONLY, req.num_prompt, 1, req.num_prompt, hash_ids=req.hash_ids)
        seq.slot = (PREFILL, address, tokens)
        self._submit(address, seq)

    def _start_decode(self, req: SimRequest, address: str, tokens: int, mode: str, chunk: int = 0) -> None:
        if mode == COLOCATED:
            seq = Seq(req, COLOCATED, req.num_prompt, req.num_output, req.num_prompt, chunk_cap=chunk,
                      hash_ids=req.hash_ids)
        else:  # arrives with the prompt's KV and the prefill's first token
            seq = Seq(req, DECODE_ONLY, req.num_prompt, req.num_output, req.num_prompt + 1, num_output=1,
                      hash_ids=req.hash_ids, num_imported=req.num_prompt)
        seq.slot = (DECODE, address, tokens)
        if mode == DECODE_ONLY:  # the read waits on the prefill's write (the lease), then takes its own time
            nbytes = req.num_prompt * self.profile.kv_bytes_per_token
            ready = self.workers[address].transfer(max(self.now + self.profile.handoff_overhead_s, req.written_s),
                                                   self.profile.kv_get(nbytes))
            self.at(ready, self._submit, address, seq)
        else:
            self._submit(address, seq)

    def _submit(self, address: str, seq: Seq) -> None:
        seq.req.workers.append(address)
        worker = self.workers[address]
        worker.add(seq)
        self._kick(worker)

    def _kick(self, worker: SimWorker) -> None:
        if worker.busy:
            return
        if not worker.has_work():
            worker.cpu_debt_s = 0.0  # the transfer ran on an idle core
            return
        plan = worker.schedule()
        if not plan.scheduled:
            return  # blocked (no KV room): the next finished request kicks it again
        seconds = worker.step_seconds(plan) + worker.cpu_debt_s  # a KV transfer's share of the core
        worker.cpu_debt_s = 0.0
        worker.busy = True
        self._steps[worker.address] = _RunningStep(plan, self.now, seconds, 1.0, self.now)
        self._retime(worker)

    def _retime(self, worker: SimWorker) -> None:
        """(Re)schedule the end of each running step on `worker`'s host at the speed the
        host's busy workers now allow."""
        mates = self._hosts[self.host_of[worker.address]]
        for w in mates:
            step = self._steps.get(w.address)
            if step is None:
                continue
            crowded = any(m.busy for m in mates if m is not w)
            factor = self.profile.neighbour_factor(bool(step.plan.prefill_chunks)) if crowded else 1.0
            if step.version and factor == step.factor:
                continue  # its end stands
            step.left_s = max(0.0, step.left_s - (self.now - step.since_s) / step.factor)
            step.since_s, step.factor, step.version = self.now, factor, next(self._seq)
            self.at(self.now + step.left_s * factor, self._step_end, w, step.version)

    def _step_end(self, worker: SimWorker, version: int) -> None:
        step = self._steps.get(worker.address)
        if step is None or step.version != version:
            return  # re-timed since
        del self._steps[worker.address]
        worker.busy = False
        for seq, done in worker.finish_step(step.plan, self.now - step.started_s):
            self._token(seq, done)
        self._kick(worker)
        self._retime(worker)  # its neighbours run alone now, unless it stepped again

    def _token(self, seq: Seq, done: bool) -> None:
        req = seq.req
        if seq.mode == PREFILL_ONLY:
            req.first_s = req.last_s = self.now
            if req.num_output > 1:  # the write of its KV, in the background on this worker
                write_s = self.profile.kv_put(req.num_prompt * self.profile.kv_bytes_per_token)
                req.written_s = self.workers[seq.slot[1]].transfer(self.now, write_s)
            self._release(seq)
            if req.num_output == 1:
                self._end(req)
            else:
                self._acquire(DECODE, req, 0, lambda r, a, t: self._start_decode(r, a, t, DECODE_ONLY))
            return
        if req.first_s is None:
            req.first_s = self.now
        else:
            req.itls.append(self.now - req.last_s)
        req.last_s = self.now
        if done:
            self._release(seq)
            self._end(req)

    def _release(self, seq: Seq) -> None:
        pool, address, tokens = seq.slot
        self.router.release(pool, address, tokens)
        self._retry_pending()

    def _end(self, req: SimRequest) -> None:
        req.end_s = self.now
        self._open -= 1


def simulate(trace: list[TraceRequest], profile: Profile, cfg: ClusterConfig) -> list[SimRequest]:
    return Cluster(cfg, profile).run(trace)
