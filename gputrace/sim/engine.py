"""The discrete-event model of a pipeline-parallel engine (SGLang, or vLLM with ``engine="vllm"``):
stage 0's micro-batch loop, admission, prefill chunks, KV capacity, per-stage steps and PCIe hand-offs.

Times are float seconds from the run's start. Stage 0 visits the ``pp_size + pp_async_batch_depth``
micro-batch slots in order (as SGLang's ``event_loop_pp`` does): a slot with running requests
waits for its previous step's outputs to come back from the last stage; on its turn a slot runs
a prefill of newly admitted requests when it may admit any, else one decode step of its
requests. SGLang admits per slot: min(K - the slot's running, the request pool's free rows); the
pool (max_running_requests) is the engine-wide bound. SGLang's prefill turn (PrefillAdder) spends
one token budget: it continues the scheduler's one chunked request first, then admits waiting
requests whole while the budget lasts, cutting the first that does not fit into the next chunked
request; whichever slot runs next takes that request's next chunk. vLLM keeps pp_size batches in flight (its
batch queue), admits engine-wide up to max_num_seqs and mixes new prefills into a decode step.
Each stage runs micro-batches in the order they were issued, so a batch's times through all
stages are known when it is issued (a flow shop).
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gputrace.sim.params import SimParams


class TokenListener(Protocol):
    """Told (ahead of time) when a request's tokens come out; the real-time server streams them."""

    def tokens(self, t_s: float, generated: int) -> None: ...

    def finished(self, t_s: float) -> None: ...


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request inside the engine."""

    rid: int
    arrival_s: float  # reaches the engine's waiting queue
    input_tokens: int
    output_tokens: int  # tokens it will generate
    phase: str | None = None
    client_start_s: float = 0.0
    prefill_target: int = 0  # prompt (plus recomputed output after a retraction) to prefill
    prefilled: int = 0
    generated: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None  # its latest token so far (ITL of a request not yet done)
    finish_s: float | None = None
    kv_tokens: int = 0  # KV-cache tokens it holds
    # prompt tokens the prefix cache held when it arrived (prefix_cached_share): not computed, but
    # held in the cache for it from its first chunk on, as its own prompt's (a running request's
    # prefix is shared with another running one only where their prompts repeat each other)
    cached_tokens: int = 0
    listener: TokenListener | None = None
    aborted: bool = False  # the client went away: it ends at its next token, as SGLang aborts it

    def __post_init__(self) -> None:
        if not self.prefill_target:
            self.prefill_target = self.input_tokens


def uncached_tokens(prompt_tokens: int, cached_share: float) -> int:
    """The tokens of a prompt its prefill computes where the prefix cache holds ``cached_share``
    of it: at least one (SGLang computes a prompt's last token whatever the cache holds)."""
    return max(1, prompt_tokens - round(cached_share * prompt_tokens))


@dataclass
class EngineTrace:
    """What the engine did, as growing columns (numpy-ready)."""

    pp_size: int
    # kernel-busy intervals, one per (step, stage): every step runs through all pp_size stages,
    # so interval i is step i // pp_size on stage i % pp_size. The float columns a replay reads
    # back as numpy are C doubles (array 'd'): numpy takes them without a copy, where a list of
    # a million Python floats took 20 ms to convert, each replay (the same values: a float is a
    # double)
    iv_start: array[float] = field(default_factory=lambda: array("d"))
    iv_end: array[float] = field(default_factory=lambda: array("d"))
    # per step: requests in it, whether it decodes only, activation bytes each stage hands on
    step_reqs: list[int] = field(default_factory=list)
    step_decode: list[bool] = field(default_factory=list)
    step_act_bytes: list[int] = field(default_factory=list)
    # tokens handed to clients (time they come out of the last stage, count)
    tok_t: array[float] = field(default_factory=lambda: array("d"))
    tok_n: list[int] = field(default_factory=list)
    # engine state at each issued batch (stage 0's view)
    st_t: list[float] = field(default_factory=list)
    st_slots_busy: list[int] = field(default_factory=list)
    st_running: list[int] = field(default_factory=list)
    st_waiting: list[int] = field(default_factory=list)
    st_kv_used: list[int] = field(default_factory=list)
    # work present in the engine: +1 at arrival, -1 at completion
    work_t: list[float] = field(default_factory=list)
    work_delta: list[int] = field(default_factory=list)
    # prompt tokens computed (time stage 0 issued them, count): vLLM's prompt throughput
    pf_t: list[float] = field(default_factory=list)
    pf_n: list[int] = field(default_factory=list)
    # kv admission stalls (time) and retractions
    kv_stall_t: list[float] = field(default_factory=list)
    retractions: int = 0

    def interval_stage(self, i: int) -> int:
        return i % self.pp_size

    def interval_bytes(self, i: int) -> tuple[int, int]:
        """(tx, rx) bytes of interval i: each stage sends its activations on but the last, and
        each receives them but the first."""
        step, stage = divmod(i, self.pp_size)
        act = self.step_act_bytes[step]
        return (act if stage < self.pp_size - 1 else 0), (act if stage > 0 else 0)

    def interval_columns(self) -> dict[str, np.ndarray]:
        """The kernel-busy intervals as arrays (stage, start_s, end_s, reqs, decode, tx_bytes,
        rx_bytes), one row per (step, stage)."""
        pp = self.pp_size
        n_steps = len(self.step_reqs)
        act = np.asarray(self.step_act_bytes, dtype=np.float64)
        stage = np.tile(np.arange(pp, dtype=np.int64), n_steps)
        return {
            "stage": stage,
            "start_s": np.asarray(self.iv_start, dtype=np.float64),
            "end_s": np.asarray(self.iv_end, dtype=np.float64),
            "reqs": np.repeat(np.asarray(self.step_reqs, dtype=np.int64), pp),
            "decode": np.repeat(np.asarray(self.step_decode, dtype=bool), pp),
            "tx_bytes": np.where(stage < pp - 1, np.repeat(act, pp), 0.0),
            "rx_bytes": np.where(stage > 0, np.repeat(act, pp), 0.0),
        }


LogEmitter = Callable[[float, int, str, dict[str, float | int | bool]], None]
"""(time, pp_rank, kind "decode"|"prefill", fields) -> None."""


class PipelineEngine:
    """The simulated engine; drive it with :meth:`add_arrival` and :meth:`run_until`."""

    def __init__(self, params: SimParams, on_log: LogEmitter | None = None,
                 on_complete: Callable[[SimRequest, float], None] | None = None):
        p = params
        self.p = p
        self.trace = EngineTrace(p.pp_size)
        self.on_log = on_log
        self.on_complete = on_complete
        self.now = 0.0
        n_slots = p.slots
        self.slots: list[list[SimRequest]] = [[] for _ in range(n_slots)]
        self.slot_ready = [0.0] * n_slots
        self.slot_chunk: list[SimRequest | None] = [None] * n_slots  # vLLM: each slot's own
        # SGLang: the scheduler's one chunked request (its next chunk goes to whichever slot runs next)
        self.chunked: SimRequest | None = None
        self.next_slot = 0
        self.stage_free = [0.0] * p.pp_size
        # with shared_cores: each stage's forwards already placed that have not ended yet
        self.placed: list[deque[tuple[float, float]]] = [deque() for _ in range(p.pp_size)]
        self.link_free = [0.0] * p.pp_size  # link s -> s + 1 carries one hand-off at a time
        self.waiting: deque[SimRequest] = deque()
        self._arrivals: list[tuple[float, int, SimRequest]] = []
        self._completions: list[tuple[float, int, SimRequest]] = []
        self._seq = 0
        self.running = 0
        self.kv_used = 0
        self.kv_reserved = 0  # future tokens promised to running requests
        # SGLang: admission holds the filled slot's future tokens at a ratio that decays
        # (OutputReservation); None: kv_reserved, engine-wide
        self.reservation = p.engine_spec.policy.output_reservation
        self.new_token_ratio = self.reservation.init_ratio if self.reservation is not None else 1.0
        self.cap = p.micro_batch_cap
        policy = p.engine_spec.policy  # how the simulated engine schedules, as its package says
        self.engine_wide = not policy.microbatch_slots  # admission engine-wide only, no per-slot K (vLLM)
        self.mixed_prefill = policy.mixed_prefill  # prefill chunks ride in the decode steps (vLLM V1)
        self.logs_steps = p.engine_spec.steps_logged  # its ranks log steps (SGLang), else engine-wide stats
        self.mults = [p.stage_multiplier(s) for s in range(p.pp_size)]
        # per-stage log counters
        self._decode_steps = [0] * p.pp_size
        self._gen_tokens = [0] * p.pp_size
        self._gen_since = [0.0] * p.pp_size
        self._in_tokens = [0] * p.pp_size
        self._in_since = [0.0] * p.pp_size
        # the device timer's window per rank: forward seconds since its previous line
        self._fwd_s = [0.0] * p.pp_size
        self._fwd_since = [0.0] * p.pp_size

    # -- driving -------------------------------------------------------------------------------

    def add_arrival(self, req: SimRequest) -> None:
        """A request that reaches the engine at ``req.arrival_s``; the part of its prompt the
        prefix cache holds (prefix_cached_share) is not computed, but is held for it (cached_tokens)."""
        if self.p.prefix_cached_share:
            req.prefill_target = uncached_tokens(req.input_tokens, self.p.prefix_cached_share)
            req.cached_tokens = req.input_tokens - req.prefill_target
        self._seq += 1
        heapq.heappush(self._arrivals, (req.arrival_s, self._seq, req))

    def process_due(self, t: float) -> None:
        """Take in the arrivals and completions due by ``t``, issuing nothing (a run that ends
        without draining still counts the requests that finished before its end)."""
        self._process_until(t)

    def busy(self) -> bool:
        """Requests waiting, running or still to arrive."""
        return bool(self.running or self.waiting or self._arrivals or self._completions)

    def run_until(self, t_end: float) -> None:
        """Advance stage 0's loop until its clock reaches ``t_end`` (a blocked step may overshoot)."""
        n_slots = len(self.slots)
        idle_turns = 0
        while self.now < t_end:
            k = self.next_slot
            if self.slot_ready[k] > t_end:
                # Stage 0 would block on this micro-batch past t_end: stop at t_end, so that
                # what the driver adds before then (a phase's new requests) is there when the
                # outputs come back and joins that batch, as the engines take requests in.
                self.now = t_end
                self._process_until(t_end)
                return
            if self._iterate():
                idle_turns = 0
                continue
            idle_turns += 1
            if idle_turns < n_slots:
                continue
            # A whole loop issued nothing: jump to the next thing that can happen.
            idle_turns = 0
            nxt = min(self._arrivals[0][0] if self._arrivals else t_end,
                      self._completions[0][0] if self._completions else t_end,
                      min((r for r in self.slot_ready if r > self.now), default=t_end))
            if nxt <= self.now:
                nxt = self.now + self.p.sched_overhead_s
            self.now = min(nxt, t_end)
            self._process_until(self.now)

    # -- one loop iteration --------------------------------------------------------------------

    def _iterate(self) -> bool:
        p = self.p
        k = self.next_slot
        self.next_slot = (k + 1) % len(self.slots)
        t = self.now
        if self.slot_ready[k] > t:
            # stage 0 blocks on this slot's outputs (a batch of it is in flight: its running
            # requests' step, or only a chunk of the chunked request)
            t = self.slot_ready[k]
        elif not self.slots[k] and self.slot_chunk[k] is None and self.chunked is None \
                and self._skip_empty(k, t):
            return False
        arrivals, completions = self._arrivals, self._completions
        if (arrivals and arrivals[0][0] <= t) or (completions and completions[0][0] <= t):
            self._process_until(t)
        self.now = t + p.sched_overhead_s
        if self.waiting or self.chunked is not None or self.slot_chunk[k] is not None:
            chunk = self._prefill_chunk(k, t)
        else:  # most turns of a loaded engine: nothing to prefill, a decode step
            chunk = []
        if chunk and not self.mixed_prefill:
            self._issue(k, t, chunk)  # SGLang: a prefill turn decodes nothing of this slot
            return True
        if chunk:
            prefilling = {id(r) for r, _ in chunk}
            decodes = [(r, 1) for r in self.slots[k]
                       if r.prefilled >= r.prefill_target and id(r) not in prefilling]
        else:
            decodes = [(r, 1) for r in self.slots[k] if r.prefilled >= r.prefill_target]
        if chunk or decodes:
            self._issue(k, t, decodes + chunk)
            return True
        return False

    def _skip_empty(self, k: int, t: float) -> bool:
        """Pass over empty slots at once when nothing can arrive meanwhile (the loop's spin)."""
        if self.waiting or not self.running:
            return False
        slots, n = self.slots, len(self.slots)
        d = 1
        while d < n and not slots[(k + d) % n]:
            d += 1
        if d >= n:
            return False
        t_next = t + d * self.p.sched_overhead_s
        if (self._arrivals and self._arrivals[0][0] <= t_next) or \
                (self._completions and self._completions[0][0] <= t_next):
            return False
        self.next_slot = (k + d) % n
        self.now = t_next
        return True

    def _process_until(self, t: float) -> None:
        """Completions and arrivals up to ``t``, in time order."""
        arrivals, completions = self._arrivals, self._completions
        while True:
            ta = arrivals[0][0] if arrivals else float("inf")
            tc = completions[0][0] if completions else float("inf")
            if min(ta, tc) > t:
                return
            if tc <= ta:
                _, _, req = heapq.heappop(completions)
                self._complete(req)
            else:
                _, _, req = heapq.heappop(arrivals)
                self.waiting.append(req)
                self.trace.work_t.append(req.arrival_s)
                self.trace.work_delta.append(1)

    def _complete(self, req: SimRequest) -> None:
        assert req.finish_s is not None
        for slot in self.slots:
            if req in slot:
                slot.remove(req)
                break
        self.running -= 1
        self.kv_used -= req.kv_tokens
        req.kv_tokens = 0
        self.trace.work_t.append(req.finish_s)
        self.trace.work_delta.append(-1)
        if self.on_complete is not None:
            self.on_complete(req, req.finish_s)

    # -- admission -----------------------------------------------------------------------------

    def _room(self, k: int) -> int:
        """Requests slot k may admit: SGLang's get_num_allocatable_reqs (its K less its running,
        bounded by the pool's free rows); vLLM's max_num_seqs less the engine's running."""
        p = self.p
        free_rows = p.max_running_requests - self.running
        if self.engine_wide:
            return free_rows
        return min(self.cap - len(self.slots[k]), free_rows)

    def _kv_fits(self, need: int) -> bool:
        return self.kv_used + self.kv_reserved + need <= self.p.max_total_num_tokens

    def _prefill_chunk(self, k: int, t: float) -> list[tuple[SimRequest, int]]:
        """The (request, prompt tokens) of slot k's prefill this turn; [] when none."""
        return self._vllm_prefill(k, t) if self.mixed_prefill else self._sglang_prefill(k, t)

    def _sglang_prefill(self, k: int, t: float) -> list[tuple[SimRequest, int]]:
        """SGLang 0.5.23's prefill turn (get_new_batch_prefill, PrefillAdder): the budget is
        chunked_prefill_size tokens (rem_chunk_tokens, which cuts a prompt) and max_prefill_tokens
        (rem_input_tokens, which only stops admission once spent). The chunked request's next
        chunk comes first, whatever K; then waiting requests while the slot's room and both budgets
        last, each whole if it fits what is left of the chunk budget, else cut there to become the
        chunked request (one per scheduler). A request joins the slot that computes its last chunk."""
        chunked = self.chunked
        if chunked is None and not self.waiting:  # most turns of a loaded engine: decode only
            if not self.running and self.reservation is not None:  # idle: the ratio starts again
                self.new_token_ratio = self.reservation.init_ratio
            return []
        p = self.p
        rem_chunk, rem_input = p.chunked_prefill_size, p.max_prefill_tokens
        out: list[tuple[SimRequest, int]] = []
        committed = 0  # KV this turn takes beyond what is held (its chunks and admitted outputs)
        if chunked is not None:
            need = chunked.prefill_target - chunked.prefilled
            take = min(need, rem_chunk)
            out.append((chunked, take))
            rem_chunk -= take
            rem_input -= take
            committed += take
            if take < need:
                return out  # the chunk spent the budget
            self.chunked = None
            self.slots[k].append(chunked)
        # a request that ended its chunks here counts against K (SGLang: it is in the turn's
        # can_run_list), and holds its pool row already
        room = min(self.cap - len(self.slots[k]), p.max_running_requests - self.running)
        self._admit(k, t, out, room, rem_chunk, rem_input, committed)
        return out

    def _held_for(self, k: int) -> float:
        """KV held against admission into slot k: what is in use, and the future tokens of the
        requests running in it at the ratio (OutputReservation), or every running request's
        (kv_reserved) where the engine reserves engine-wide."""
        if self.reservation is None:
            return self.kv_used + self.kv_reserved
        ratio = self.new_token_ratio
        return self.kv_used + ratio * sum(r.output_tokens - r.generated for r in self.slots[k])

    def _admit(self, k: int, t: float, out: list[tuple[SimRequest, int]], room: int,
               rem_chunk: int, rem_input: int, committed: float = 0.0) -> None:
        """SGLang's admission loop over the waiting queue into ``out`` (see _sglang_prefill): a
        request fits with its prompt and all its output beside what slot k holds (_held_for) and
        what this turn already took (``committed``)."""
        waiting = self.waiting
        held = self._held_for(k) + committed if waiting else 0.0
        total = self.p.max_total_num_tokens
        while waiting and room > 0 and rem_chunk > 0 and rem_input > 0:
            req = waiting[0]
            need = req.prefill_target - req.prefilled
            claim = need + req.output_tokens - req.generated + (req.cached_tokens if not req.prefilled else 0)
            if held + claim > total:
                if not self.running and not out:
                    self._reject(waiting.popleft(), t)
                    continue
                self.trace.kv_stall_t.append(t)
                return
            waiting.popleft()
            take = min(need, rem_chunk)
            rem_chunk -= take
            rem_input -= take
            room -= 1
            held += claim
            self.running += 1
            self.kv_reserved += req.output_tokens - req.generated
            out.append((req, take))
            if take < need:
                self.chunked = req  # it joins a slot with its last chunk
                return
            self.slots[k].append(req)

    def _reject(self, req: SimRequest, t: float) -> None:
        """A request that can never fit the KV cache: SGLang rejects it; here it is dropped."""
        req.finish_s = t
        self.trace.work_t.append(t)
        self.trace.work_delta.append(-1)
        if req.listener is not None:
            req.listener.finished(t)
        if self.on_complete is not None:
            self.on_complete(req, t)

    def _vllm_prefill(self, k: int, t: float) -> list[tuple[SimRequest, int]]:
        """vLLM's prefill share of slot k's step: each slot continues its own partial prefill."""
        chunked = self.slot_chunk[k]
        if chunked is None and not self.waiting:  # most turns of a loaded engine: decode only
            return []
        p = self.p
        budget = min(p.chunked_prefill_size, p.max_prefill_tokens)
        if chunked is not None:
            take = min(chunked.prefill_target - chunked.prefilled, budget)
            return [(chunked, take)]
        room = self._room(k)
        out: list[tuple[SimRequest, int]] = []
        waiting = self.waiting
        while waiting and room > 0 and budget > 0:
            req = waiting[0]
            need = req.prefill_target - req.prefilled
            cached = req.cached_tokens if not req.prefilled else 0
            if not self._kv_fits(need + cached + req.output_tokens - req.generated):
                if not self.running and not out:
                    self._reject(waiting.popleft(), t)
                    continue
                self.trace.kv_stall_t.append(t)
                break
            waiting.popleft()
            take = min(need, budget)
            budget -= take
            room -= 1
            self.running += 1
            self.kv_reserved += req.output_tokens - req.generated
            self.slots[k].append(req)
            out.append((req, take))
            if take < need:
                self.slot_chunk[k] = req
                break
        return out

    # -- issuing a batch through the pipeline --------------------------------------------------

    def _issue(self, k: int, t: float, batch: list[tuple[SimRequest, int]]) -> None:
        """One step of slot k through every stage: its decodes (n = 1) and prefill chunks."""
        p = self.p
        tr = self.trace
        n_reqs = len(batch)
        prompt = tokens = ctx_tokens = cached = 0
        for r, n in batch:
            tokens += n
            if r.prefilled < r.prefill_target:
                prompt += n
                if not r.prefilled:
                    cached += r.cached_tokens
            ctx_tokens += r.prefilled + r.generated
        if not p.context_token_s:
            ctx_tokens = 0
        decode = prompt == 0
        # KV: decode needs one slot per request; retract the newest when the cache is full.
        if decode and self.kv_used + tokens > p.max_total_num_tokens:
            batch = self._retract(k, batch)
            n_reqs = len(batch)
            tokens = n_reqs
            if self.reservation is not None:  # SGLang: the ratio from what the others decoded
                steps = self.reservation.retract_decode_steps
                self.new_token_ratio = min(1.0, (sum(r.generated for r, _ in batch) + steps * n_reqs)
                                           / (sum(r.output_tokens for r, _ in batch) + 1))
            if not batch:
                return
        elif decode and self.reservation is not None:
            self.new_token_ratio = max(self.new_token_ratio - self.reservation.decay_per_step,
                                       self.reservation.min_ratio)
        self.kv_used += tokens + cached
        if prompt:
            tr.pf_t.append(t)
            tr.pf_n.append(prompt)
        tr.st_t.append(t)
        slots = self.slots
        tr.st_slots_busy.append(len(slots) - slots.count([]))
        tr.st_running.append(self.running)
        tr.st_waiting.append(len(self.waiting))
        tr.st_kv_used.append(self.kv_used)
        act_bytes = tokens * p.activation_bytes_per_token
        xfer = act_bytes / p.pcie_bandwidth_bytes_per_s
        lat = p.pcie_latency_s
        stage_free, link_free, last = self.stage_free, self.link_free, p.pp_size - 1
        compute = p.decode_token_s * (tokens - prompt) + p.prefill_token_s * prompt
        memory = p.weight_read_s + (self._expert_share(tokens) * p.expert_read_s if p.moe_experts else 0.0)
        base = p.launch_s + max(memory, compute) + p.context_token_s * ctx_tokens
        queue_s = p.queued_request_s * len(self.waiting)  # rank 0's, before its forward
        log = self.on_log is not None and self.logs_steps  # vLLM logs engine-wide stats instead
        if log or p.shared_cores > 0:
            end = self._run_stages_logged(k, t, batch, tokens, n_reqs, decode, base, queue_s, xfer, lat)
        else:
            # the hottest loop of every replay: locals only, bound methods, one branch a stage
            # (the same arithmetic as _run_stages_logged, in the same order: the same trace)
            add_start, add_end = tr.iv_start.append, tr.iv_end.append
            mults = self.mults
            arrive = t
            end = t
            for s in range(last + 1):
                free = stage_free[s]
                start = arrive if arrive > free else free
                end = start + (mults[s] * base + queue_s if s == 0 else mults[s] * base)
                stage_free[s] = end
                add_start(start)
                add_end(end)
                if s < last:
                    free = link_free[s]
                    sent = (end if end > free else free) + xfer
                    link_free[s] = sent
                    arrive = sent + lat
        if p.synchronous_forward:
            # stage 0's forward runs on the scheduler's own thread: its loop goes on (and takes in
            # new requests, for the next slot) only once that forward is done
            self.now = max(self.now, stage_free[0])
        tr.step_reqs.append(n_reqs)
        tr.step_decode.append(decode)
        tr.step_act_bytes.append(act_bytes)
        done = end + p.pcie_latency_s
        self.slot_ready[k] = done
        self._advance_requests(k, batch, done)

    def _run_stages_logged(self, k: int, t: float, batch: list[tuple[SimRequest, int]], tokens: int,
                           n_reqs: int, decode: bool, base: float, queue_s: float, xfer: float,
                           lat: float) -> float:
        """_issue's walk through the stages where it writes log lines or the stages share cores;
        the last stage's end."""
        p = self.p
        tr = self.trace
        stage_free, link_free, last = self.stage_free, self.link_free, p.pp_size - 1
        starts, ends = tr.iv_start, tr.iv_end
        log = self.on_log is not None and self.logs_steps  # vLLM logs engine-wide stats instead
        gen_tokens, steps, interval = self._gen_tokens, self._decode_steps, p.decode_log_interval
        mults = self.mults
        shared = p.shared_cores > 0
        arrive = t
        end = t
        for s in range(last + 1):
            free = stage_free[s]
            start = arrive if arrive > free else free
            work = mults[s] * base + (queue_s if s == 0 else 0.0)
            end = start + work
            if shared:  # waiting for a core is not compute: the stage's busy time is its work
                end = self._shared_end(s, t, start, work)
                start = end - work
            stage_free[s] = end
            starts.append(start)
            ends.append(end)
            if log:
                self._fwd_s[s] += end - start
                if not decode:
                    self._log_prefill(s, start, k, batch, tokens)
                else:
                    gen_tokens[s] += tokens
                    steps[s] += 1
                    if steps[s] % interval == 0:
                        self._log_decode(s, end, n_reqs)
            if s < last:
                free = link_free[s]
                sent = (end if end > free else free) + xfer
                link_free[s] = sent
                arrive = sent + lat
        return end

    def _shared_end(self, s: int, now: float, start: float, work_s: float) -> float:
        """When stage s's forward of ``work_s`` (at full speed) begun at ``start`` ends on cores
        the stages share: the forwards placed before it keep a core each, and it runs on what is
        left of shared_cores (at most one core) while they run. Forwards that ended by ``now``
        (the loop's time, which only grows) are dropped."""
        cores = self.p.shared_cores
        edges: list[tuple[float, int]] = []
        for other, placed in enumerate(self.placed):
            while placed and placed[0][1] <= now:
                placed.popleft()
            if other == s:
                continue
            for a, b in placed:
                if b > start:
                    edges.append((a if a > start else start, 1))
                    edges.append((b, -1))
        edges.sort()
        t, running, left = start, 0, work_s
        for edge_t, delta in edges:
            speed = min(1.0, max(cores - running, 0.0))
            if edge_t > t and speed > 0:
                if left <= speed * (edge_t - t):
                    break
                left -= speed * (edge_t - t)
            t = edge_t if edge_t > t else t
            running += delta
        else:
            speed = min(1.0, max(cores - running, 0.0))
        end = t + left / speed
        # as one stretch of compute ending at ``end``: where it waited before computing (the
        # forwards take turns) that is where it computed; what starts later sees the rest
        self.placed[s].append((end - work_s, end))
        return end

    def _expert_share(self, tokens: int) -> float:
        """The share of the routed experts ``tokens`` touch, each picking top_k of E at random."""
        p = self.p
        return 1.0 - (1.0 - p.moe_top_k / p.moe_experts) ** tokens

    def _advance_requests(self, k: int, batch: list[tuple[SimRequest, int]], done: float) -> None:
        emitted = 0
        released = 0  # future tokens no longer promised (ints: summed in any order, the same)
        for req, n in batch:
            req.kv_tokens += n if req.prefilled else n + req.cached_tokens
            if req.prefilled < req.prefill_target:
                req.prefilled += n
                if req.prefilled < req.prefill_target:
                    continue
                if self.slot_chunk[k] is req:
                    self.slot_chunk[k] = None
            generated = req.generated = req.generated + 1
            emitted += 1
            if req.first_token_s is None:
                req.first_token_s = done
            req.last_token_s = done
            listener = req.listener
            if listener is not None:
                listener.tokens(done, generated)
            if generated >= req.output_tokens or req.aborted:
                req.finish_s = done
                released += max(req.output_tokens - generated, 0)
                if listener is not None:
                    listener.finished(done)
                self._seq += 1
                heapq.heappush(self._completions, (done, self._seq, req))
        if emitted:
            self.kv_reserved -= emitted + released
            self.trace.tok_t.append(done)
            self.trace.tok_n.append(emitted)

    def _retract(self, k: int, batch: list[tuple[SimRequest, int]]) -> list[tuple[SimRequest, int]]:
        """Free KV by sending the newest requests of this batch back to the queue (recomputed)."""
        keep = list(batch)
        while keep and self.kv_used + len(keep) > self.p.max_total_num_tokens:
            req, _ = keep.pop()
            self.slots[k].remove(req)
            self.running -= 1
            self.kv_used -= req.kv_tokens
            self.kv_reserved -= req.output_tokens - req.generated
            req.kv_tokens = 0
            req.prefill_target = req.input_tokens - req.cached_tokens + req.generated
            req.prefilled = 0
            self.waiting.appendleft(req)
            self.trace.retractions += 1
        return keep

    # -- scheduler log lines -------------------------------------------------------------------

    def _log_decode(self, s: int, end: float, n_reqs: int) -> None:
        assert self.on_log is not None
        p = self.p
        gap = max(end - self._gen_since[s], 1e-9)
        fields: dict[str, float | int | bool] = {
            "running_req": n_reqs, "num_token": self.kv_used,
            "token_usage": self.kv_used / p.max_total_num_tokens, "cuda_graph": n_reqs <= p.cuda_graph_max_bs,
            "gen_throughput": self._gen_tokens[s] / gap, "queue_req": len(self.waiting)}
        self._gen_tokens[s] = 0
        self._gen_since[s] = end
        self._occupancy(s, end, fields)
        self.on_log(end, s, "decode", fields)

    def _log_prefill(self, s: int, start: float, k: int, batch: list[tuple[SimRequest, int]],
                     tokens: int) -> None:
        assert self.on_log is not None
        gap = max(start - self._in_since[s], 1e-9)
        self._in_tokens[s] += tokens
        # SGLang's #new-seq is the prefill batch's len(can_run_list): a continued chunk counts
        # in every turn that computes one of its chunks, not only the first
        new_seq = sum(1 for r, _ in batch if r.prefilled < r.prefill_target)
        in_batch = {id(r) for r, _ in batch}
        fields: dict[str, float | int | bool] = {
            "new_seq": new_seq, "new_token": tokens,
            "cached_token": sum(r.cached_tokens for r, _ in batch if r.prefilled == 0),
            "token_usage": self.kv_used / self.p.max_total_num_tokens,
            # the slot's running batch before this turn's requests join it
            "running_req": sum(1 for r in self.slots[k] if id(r) not in in_batch),
            "queue_req": len(self.waiting),
            "pending_token": sum(r.prefill_target - r.prefilled for r in self.waiting),
            "input_throughput": self._in_tokens[s] / gap}
        self._in_tokens[s] = 0
        self._in_since[s] = start
        # the step this line announces has not run yet: its forward counts in the next window
        self._fwd_s[s] -= self.trace.iv_end[-1] - self.trace.iv_start[-1]
        self._occupancy(s, start, fields)
        self._fwd_s[s] += self.trace.iv_end[-1] - self.trace.iv_start[-1]
        self.on_log(start, s, "prefill", fields)

    def _occupancy(self, s: int, t: float, fields: dict[str, float | int | bool]) -> None:
        """The device timer's share: forward time over the wall time since the rank's last line
        (idle with no work counted in fwd+idle)."""
        if not self.p.device_timer:
            return
        wall = t - self._fwd_since[s]
        share = min(self._fwd_s[s] / wall, 1.0) if wall > 0 else 0.0
        fields["fwd_occupancy"] = share
        fields["fwd_idle_occupancy"] = share if self.running or self.waiting else 1.0
        self._fwd_s[s] = 0.0
        self._fwd_since[s] = t
