"""One simulated worker: the engine's scheduler rules (engine/core/scheduler.py) over
token counts, and step times from a Profile. No tokens, no tensors: a sequence is its
`num_tokens` and `num_computed`, and each step gives it up to the rest, as the engine does.

    prompt:  [==========computed==========|--chunk this step--|.....rest.....]
             chunk = min(rest, long_prefill_token_threshold, request's cap, step budget left)

Rules kept: one token budget per step (max_num_batched_tokens), running sequences first,
then waiting ones in order while max_num_seqs allows; the head of the queue is never
skipped; KV blocks allocated per block_size tokens, recompute preemption of the latest
admitted when they run out; a local prefix cache of the trace's hash ids (LRU).
Modes as the engine's: colocated, prefill-only (ends after the first token), decode-only
(arrives with the prompt's KV and its first token).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.engine.step_rates import StepRates
from pdserve.sim.profile import Profile
from pdserve.sim.trace import TRACE_BLOCK_SIZE

COLOCATED, PREFILL_ONLY, DECODE_ONLY = "colocated", "prefill_only", "decode_only"


@dataclass(eq=False)
class Seq:
    """A request's state on one worker."""
    req: object                   # the cluster's record (SimRequest)
    mode: str
    num_prompt: int
    num_output_target: int
    num_tokens: int               # prompt + tokens sampled so far
    num_computed: int = 0
    num_output: int = 0           # sampled tokens (the prefill's first one included)
    chunk_cap: int = 0            # 0: the engine's threshold
    num_blocks: int = 0
    admitted: bool = False
    hash_ids: tuple = ()
    num_imported: int = 0         # decode-only: prompt tokens whose KV came with it (dropped on preemption)


@dataclass
class StepPlan:
    scheduled: list = field(default_factory=list)   # (seq, num_new)
    prefill_chunks: list = field(default_factory=list)  # num_new of each prefill chunk
    num_decodes: int = 0
    context_sum: int = 0
    preempted: bool = False

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.prefill_chunks)


class SimWorker:
    def __init__(self, address: str, profile: Profile):
        self.address = address
        self.profile = profile
        lim = profile.scheduler
        self.max_num_seqs, self.budget = lim.max_num_seqs, lim.max_num_batched_tokens
        self.threshold, self.block_size = lim.long_prefill_token_threshold, lim.block_size
        self.num_total_blocks = self.num_free_blocks = lim.num_kv_blocks
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.rates = StepRates()              # the engine's own estimator of its step costs
        self.busy = False
        self.num_preemptions = 0
        self.busy_s = 0.0
        self.cpu_debt_s = 0.0                 # core time other work took since the last step began
        self.transfers_end_s = 0.0            # when the KV transfers queued here are done
        # hash ids whose KV this worker's prefix cache holds, oldest first
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._cache_units = max(1, lim.num_kv_blocks * lim.block_size // TRACE_BLOCK_SIZE)

    # ---- requests --------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def transfer(self, start_s: float, seconds: float) -> float:
        """A KV transfer of `seconds` (alone on a core) from `start_s`, beside this worker's
        steps; when it ends. With work here it shares the core, so it lasts
        (1 + kv_cpu_share)x as long and its CPU time delays the next step; on an idle core
        it costs nothing else. Transfers on one worker run one after another: four prompts
        that end in one step write 4x the bytes through the same core (or NIC), and the
        last one's decode waits for all of them."""
        if self.busy or self.has_work():
            self.cpu_debt_s += seconds * self.profile.kv_cpu_share
            seconds *= 1.0 + self.profile.kv_cpu_share
        self.transfers_end_s = max(start_s, self.transfers_end_s) + seconds
        return self.transfers_end_s

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.budget)
        if not plan.preempted:  # as the engine: no admissions in a step that preempted
            self._schedule_waiting(plan, budget)
        return plan

    def step_seconds(self, plan: StepPlan) -> float:
        mean_ctx = plan.context_sum / plan.num_decodes if plan.num_decodes else 0.0
        return self.profile.step_s(plan.prefill_chunks, plan.num_decodes, mean_ctx)

    def _chunk(self, seq: Seq, budget: int) -> int:
        cap = min(self.threshold, seq.chunk_cap) if seq.chunk_cap else self.threshold
        return min(seq.num_tokens - seq.num_computed, cap, budget)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        i, bs = 0, self.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            c = seq.num_computed
            if seq.num_tokens - c == 1 and c >= seq.num_prompt:  # a decode: the common case, kept short
                need = (c + bs) // bs - seq.num_blocks
                if need <= self.num_free_blocks:
                    seq.num_blocks += need
                    self.num_free_blocks -= need
                    plan.scheduled.append((seq, 1))
                    plan.num_decodes += 1
                    plan.context_sum += c
                    seq.num_computed = c + 1
                    budget -= 1
                    i += 1
                    continue
            num_new = self._chunk(seq, budget)
            need = self._blocks_for(seq.num_computed + num_new) - seq.num_blocks
            while need > self.num_free_blocks:
                victim = self.running.pop()  # the latest admitted
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.admitted is False:    # it was its own victim
                break
            self._take(seq, num_new, need, plan)
            budget -= num_new
            i += 1
        return budget

    def _preempt(self, seq: Seq, plan: StepPlan) -> None:
        """Recompute preemption: drop the KV, keep the tokens, back to the queue's front."""
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks, seq.num_computed, seq.admitted, seq.num_imported = 0, 0, False, 0
        self.num_preemptions += 1
        plan.preempted = True
        self.waiting.appendleft(seq)
        for k, (s, n) in enumerate(plan.scheduled):
            if s is seq:
                del plan.scheduled[k]
                self._uncount(plan, n, s)
                break

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self._reused_tokens(seq)
            num_new = min(seq.num_tokens - computed, budget,
                          min(self.threshold, seq.chunk_cap) if seq.chunk_cap else self.threshold)
            need = self._blocks_for(computed + num_new)
            if num_new <= 0 or need > self.num_free_blocks:
                break
            self.waiting.popleft()
            seq.num_computed, seq.admitted = computed, True
            self.running.append(seq)
            self._take(seq, num_new, need, plan)
            budget -= num_new

    def _reused_tokens(self, seq: Seq) -> int:
        """Tokens not computed here: a decode-only request's imported KV, or the local
        prefix cache's leading hash ids (never the prompt's last token: it samples)."""
        if seq.num_imported:
            return seq.num_imported
        run = 0
        for h in seq.hash_ids:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            run += 1
        return min(run * TRACE_BLOCK_SIZE, seq.num_tokens - 1) // self.block_size * self.block_size

    def _take(self, seq: Seq, num_new: int, need: int, plan: StepPlan) -> None:
        seq.num_blocks += need
        self.num_free_blocks -= need
        plan.scheduled.append((seq, num_new))
        self._count(plan, num_new, seq)
        seq.num_computed += num_new

    @staticmethod
    def _count(plan: StepPlan, num_new: int, seq: Seq) -> None:
        if num_new == 1 and seq.num_computed >= seq.num_prompt:
            plan.num_decodes += 1
            plan.context_sum += seq.num_computed
        else:
            plan.prefill_chunks.append(num_new)

    @staticmethod
    def _uncount(plan: StepPlan, num_new: int, seq: Seq) -> None:
        if num_new == 1 and seq.num_computed - 1 >= seq.num_prompt:
            plan.num_decodes -= 1
            plan.context_sum -= seq.num_computed - 1
        else:
            plan.prefill_chunks.remove(num_new)

    def finish_step(self, plan: StepPlan, seconds: float) -> list[tuple[Seq, bool]]:
        """The step's sampled tokens: (seq, finished) for each sequence that got one."""
        self.rates.observe(plan.num_prefill_tokens, plan.num_decodes, seconds)
        self.busy_s += seconds
        out = []
        for seq, _ in plan.scheduled:
            if not seq.admitted or seq.num_computed < seq.num_tokens:
                continue  # preempted meanwhile, or a prefill chunk that is not the last
            seq.num_output += 1
            seq.num_tokens += 1
            done = seq.num_output >= seq.num_output_target or seq.mode == PREFILL_ONLY
            if seq.num_output == 1 or seq.mode == DECODE_ONLY and seq.num_output == 2:
                self._remember(seq.hash_ids)
            if done:
                self._free(seq)
            out.append((seq, done))
        return out

    def _free(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks, seq.admitted = 0, False

    def _remember(self, hash_ids) -> None:
        for h in hash_ids:
            self._cache[h] = None
            self._cache.move_to_end(h)
        while len(self._cache) > self._cache_units:
            self._cache.popitem(last=False)

    # ---- what GetLoad reports --------------------------------------------------------
    def load(self) -> dict:
        queued = sum(s.num_tokens - s.num_computed for s in self.waiting) + sum(
            s.num_tokens - s.num_computed for s in self.running if s.num_tokens - s.num_computed > 1)
        return dict(num_running=len(self.running), num_waiting=len(self.waiting), num_queued_prefill_tokens=queued,
                    num_free_kv_blocks=self.num_free_blocks, num_total_kv_blocks=self.num_total_blocks,
                    max_num_seqs=self.max_num_seqs, prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
                    decode_step_ms=self.rates.decode_step_s * 1000)
