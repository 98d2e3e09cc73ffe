"""In-flight batching for the server: requests join the running batch between steps.

A background thread loops: admit queued requests up to ``max_batch_size`` (prefilled together and
merged into the running groups), run one step of every group (a speculative round, or one decode
step for requests with ``speculative: false``), stream each sequence's new tokens through its
callback, and drop finished and cancelled sequences, freeing their state. The queue is bounded: a
request beyond it is refused with a clear error, never crashing the server.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from runtime.batching import PlainGroup, Sequence, SpeculativeGroup
from runtime.sampling import LOGPROBS_MODES, SamplingParams, seeded_generator


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    end_ids: frozenset = frozenset()
    stop_words: tuple = ()     # generation stops after any of these token sequences (kept in the output)
    bad_words: tuple = ()      # token sequences: a single token is banned, a longer one's last token after the rest
    speculative: bool = True
    top_k: int = 0
    min_length: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0           # with logprobs: each token's most probable alternatives, up to MAX_TOP_LOGPROBS
    max_draft: int | None = None    # this request's K (None: the engine's)
    prompt_ignore_length: int = 0   # the first prompt tokens presence and frequency penalties leave out


MAX_TOP_LOGPROBS = 20   # vLLM's default max_logprobs


class SchedulerError(ValueError):
    """A request that cannot be served (bad field or full queue); one line naming the field."""


class Scheduler:
    def __init__(self, loaded, max_batch_size: int | None = None, max_queue: int = 64,
                 logprobs_mode: str = "processed_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise SchedulerError(f"--logprobs_mode: expected one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.loaded = loaded
        self.max_batch_size = max_batch_size or loaded.max_batch_size
        self.max_queue = max_queue
        self.raw_logprobs = logprobs_mode == "raw_logprobs"
        capacity, chunk = loaded.max_seq_len, loaded.max_input_len
        self.plain = PlainGroup(loaded.runner, capacity, chunk)
        self.spec = (SpeculativeGroup(loaded.runner, loaded.proposer, loaded.max_draft_len, capacity, chunk,
                                      loaded.draft_policy) if loaded.speculative else None)
        self._queue: deque = deque()
        self._cancelled: set[int] = set()
        self._admitting = 0   # requests taken off the queue whose prefill has not yet put them in a group
        self._lock = threading.Condition()
        self._next_id = 0
        self._thread = None
        self._stopping = False
        self.metrics = {"active_sequences": 0, "queued": 0, "steps": 0, "generated_tokens": 0,
                        "accepted_tokens": 0, "verify_rows": 0, "draft_seconds": 0.0, "verify_seconds": 0.0,
                        "spec_steps": 0,   # steps of the speculative group (draft and verify seconds are its)
                        "max_batch_seen": 0, "requests_completed": 0, "requests_cancelled": 0,
                        # steps that raised since the last one that did not: a device error that repeats
                        # fails every request while the process lives (the supervisor reads it)
                        "failed_steps_in_a_row": 0}
        self.batch_sizes: Counter = Counter()

    # --- requests --------------------------------------------------------------------------------
    def validate(self, r: Request) -> None:
        vocab, cfg = self.loaded.config.vocab_size, self.loaded
        if not r.prompt_ids:
            raise SchedulerError("text_input: the prompt is empty")
        bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise SchedulerError(f"input_ids: token {bad[0]} outside the vocabulary [0, {vocab})")
        if len(r.prompt_ids) > cfg.max_input_len:
            raise SchedulerError(f"text_input: prompt of {len(r.prompt_ids)} tokens exceeds max_input_len {cfg.max_input_len}")
        if r.max_new_tokens <= 0:
            raise SchedulerError(f"max_tokens: expected a positive number, got {r.max_new_tokens}")
        if len(r.prompt_ids) + r.max_new_tokens > cfg.max_seq_len:
            raise SchedulerError(f"max_tokens: prompt ({len(r.prompt_ids)}) + max_tokens ({r.max_new_tokens}) exceeds "
                                 f"max_seq_len {cfg.max_seq_len}")
        if r.temperature < 0:
            raise SchedulerError(f"temperature: expected >= 0, got {r.temperature}")
        if not 0 < r.top_p <= 1:
            raise SchedulerError(f"top_p: expected a value in (0, 1], got {r.top_p}")
        if r.top_k < 0:
            raise SchedulerError(f"top_k: expected >= 0 (0: no cut), got {r.top_k}")
        if not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SchedulerError(f"top_logprobs: expected 0..{MAX_TOP_LOGPROBS}, got {r.top_logprobs}")
        if r.min_length < 0:
            raise SchedulerError(f"min_length: expected >= 0, got {r.min_length}")
        if not r.repetition_penalty > 0:
            raise SchedulerError(f"repetition_penalty: expected > 0 (1: none), got {r.repetition_penalty}")
        k = self.loaded.max_draft_len or 0
        if r.max_draft is not None and not 0 <= r.max_draft <= k:
            raise SchedulerError(f"num_draft_tokens: expected 0..{k} (the engine's max_draft_len), got {r.max_draft}")

    def submit(self, request: Request, on_tokens) -> int:
        """Queues a request; ``on_tokens(new_ids, finished, info)`` is called from the scheduler thread."""
        self.validate(request)
        with self._lock:
            # the queue is admitted between steps: the requests in it that free batch slots will take
            # at the next step are not waiting, nor are cancelled ones (dropped at admission); a
            # cancelled sequence still in the batch leaves at the step's sweep, so its slot counts as
            # free (a client that stops a stream at its stop string sent the next request at once,
            # and it was refused as busy at --max_queue 0)
            running = sum(1 for g in self._groups() for s in g.seqs if s.request_id not in self._cancelled)
            free = max(0, self.max_batch_size - running - self._admitting)
            waiting = sum(1 for q in self._queue if q[0] not in self._cancelled) - free
            if waiting >= self.max_queue:
                raise SchedulerError(f"server busy: {waiting} requests queued beyond the batch (max_queue "
                                     f"{self.max_queue}); retry later")
            request_id = self._next_id
            self._next_id += 1
            self._queue.append((request_id, request, on_tokens))
            self.metrics["queued"] = len(self._queue)
            self._lock.notify()
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    # --- the loop --------------------------------------------------------------------------------
    def _groups(self):
        return [g for g in (self.spec, self.plain) if g is not None]

    def _active(self) -> int:
        return sum(len(g.seqs) for g in self._groups())

    def _admit(self):
        with self._lock:
            room = self.max_batch_size - self._active()
            taken = []
            while self._queue and room > 0:
                request_id, r, cb = self._queue.popleft()
                if request_id in self._cancelled:
                    self._cancelled.discard(request_id)
                    self.metrics["requests_cancelled"] += 1
                    continue
                taken.append((request_id, r, cb))
                room -= 1
            self.metrics["queued"] = len(self._queue)
            # neither queued nor active while they prefill: counted, or requests arriving meanwhile saw
            # their slots free and the queue went past max_queue (67 of 64 under load)
            self._admitting = len(taken)
        try:
            self._start(taken)
        finally:
            with self._lock:
                self._admitting = 0

    def _start(self, taken):
        """Prefills the requests ``_admit`` took and puts each into its group."""
        by_group = {}
        for request_id, r, cb in taken:
            generator = seeded_generator(r.seed)
            params = SamplingParams(r.temperature, r.top_p, generator, tuple(w[0] for w in r.bad_words if len(w) == 1),
                                    r.top_k, r.repetition_penalty, r.presence_penalty, r.frequency_penalty,
                                    r.min_length, r.logprobs, tuple(tuple(w) for w in r.bad_words if len(w) > 1),
                                    r.top_logprobs, self.raw_logprobs, r.prompt_ignore_length)
            seq = Sequence(list(r.prompt_ids), r.max_new_tokens, params, frozenset(r.end_ids),
                           tuple(tuple(w) for w in r.stop_words), request_id=request_id, on_tokens=cb,
                           max_draft=r.max_draft, admitted_ns=time.time_ns())
            group = self.spec if (r.speculative and self.spec is not None) else self.plain
            by_group.setdefault(id(group), (group, []))[1].append(seq)
        failed = None
        for group, seqs in by_group.values():
            try:
                emitted = group.add(seqs)
                with self._lock:
                    self._admitting -= len(seqs)   # in the group now: counted as active
            except Exception as error:   # their prefill failed: they hear it now (step fails the running)
                self._fail([s for s in seqs if all(s is not g for g in group.seqs)], f"{type(error).__name__}: {error}")
                failed = failed or error
                continue   # the other group's newcomers were taken off the queue too: they are added (or hear)
            self._deliver(seqs, emitted)
        if failed is not None:
            raise failed

    def _deliver(self, seqs, tokens):
        for seq, new in zip(seqs, tokens):
            self.metrics["generated_tokens"] += len(new)
            k = (self.loaded.max_draft_len or 0) if seq.max_draft is None else seq.max_draft
            info = {"speculation": seq.speculation_stats(k), "admitted_ns": seq.admitted_ns}
            if seq.params.logprobs:
                info["logprobs"] = seq.logprobs[len(seq.logprobs) - len(new):] if new else []
            if seq.params.top_logprobs:
                info["top_logprobs"] = seq.alternatives[len(seq.alternatives) - len(new):] if new else []
            if seq.finished:
                info["mean_accepted_tokens"] = seq.mean_accepted_tokens
                info["finish_reason"] = seq.finish_reason
                info["ended_at_end_id"] = seq.ended_at_end_id
            try:
                seq.on_tokens(new, seq.finished, info)
            except Exception:  # a broken client must not stop the batch
                seq.finished = True

    def _sweep(self):
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for group in self._groups():
            keep = []
            for i, s in enumerate(group.seqs):
                if s.request_id in cancelled:
                    self.metrics["requests_cancelled"] += 1
                elif s.finished:
                    self.metrics["requests_completed"] += 1
                else:
                    keep.append(i)
            if len(keep) < len(group.seqs):
                group.drop(keep)
        with self._lock:  # cancellations of requests still queued wait for _admit
            self._cancelled |= {c for c in cancelled if any(q[0] == c for q in self._queue)}

    def step(self) -> bool:
        """Admit, one step of every group, deliver, sweep. Returns whether work remains."""
        try:
            self._admit()
            self._sweep()
            active = self._active()
            if active:
                self.metrics["max_batch_seen"] = max(self.metrics["max_batch_seen"], active)
                self.batch_sizes[active] += 1
            for group in self._groups():
                if group.seqs:
                    seqs = list(group.seqs)
                    self._deliver(seqs, group.step())
            self.metrics["steps"] += 1
            self.metrics["failed_steps_in_a_row"] = 0
            self._sweep()
        except Exception as error:  # fail the running requests, keep serving
            self.metrics["failed_steps_in_a_row"] += 1
            self._fail_all(f"{type(error).__name__}: {error}")
        if self.spec is not None:
            self.metrics.update(spec_steps=self.spec.steps,
                                draft_seconds=self.spec.draft_seconds, verify_seconds=self.spec.verify_seconds,
                                accepted_tokens=sum(n * c for n, c in self.spec.histogram.items()),
                                verify_rows=sum(self.spec.histogram.values()),
                                draft_tokens=self.spec.draft_tokens,
                                accepted_draft_tokens=sum(self.spec.accepted_at.values()),
                                accepted_at=dict(self.spec.accepted_at))
        self.metrics["active_sequences"] = self._active()
        with self._lock:
            return bool(self._queue) or self._active() > 0

    def _fail_all(self, message):
        for group in self._groups():
            self._fail(group.seqs, message)
            group.drop([])

    @staticmethod
    def _fail(seqs, message):
        for s in seqs:
            try:
                s.on_tokens([], True, {"error": message})
            except Exception:
                pass

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nemospec-scheduler", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stopping:
            with self._lock:
                while not self._stopping and not self._queue and self._active() == 0 and not self._cancelled:
                    self._lock.wait(timeout=0.5)
            if self._stopping:
                break
            self.step()   # no sleep(0) between steps: it cost ~80 us here (timer slack), a sixth of a
            # compiled decode step; other threads get the GIL whenever a step's graph or op releases it

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
