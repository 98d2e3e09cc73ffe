"""In-flight batches: sequences join (prefill) and leave (finished, cancelled) between steps.

``PlainGroup`` decodes one token per step for its sequences; ``SpeculativeGroup`` runs one
propose -> verify -> accept -> roll back round per step. Both hold the batched state of their
sequences and merge a prefilled newcomer's state rows into it. Offline generation and the
server's scheduler drive the same groups, so a served request decodes exactly as offline.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from runtime import acceptance
from runtime.prefill import prefill
from runtime.adaptive_draft_len import (PositionFactors, StepCostTable, best_length, candidate_lengths,
                                        sequence_rates)
from runtime.draft_policy import AcceptanceTracker, DraftPolicy
from runtime.logits_shaping import shape, token_logprobs, top_logprobs
from runtime.sampling import SamplingParams, draw
from runtime.step_costs import StepCosts, Stopwatch


@dataclass
class Sequence:
    """One request's progress. ``emit`` appends tokens until an end id, a stop sequence or the limit."""
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    end_ids: frozenset = frozenset()
    stop_words: tuple = ()
    outputs: list = field(default_factory=list)
    position: int = 0          # position of the last token (the next chunk starts there)
    last: int = 0
    finished: bool = False
    gained: Counter = field(default_factory=Counter)   # verify steps by tokens gained
    drafted: int = 0                                    # draft tokens proposed for it (verified or not)
    max_draft: int | None = None                        # its own K (None: the group's)
    logprobs: list = field(default_factory=list)        # per emitted token, when params.logprobs
    alternatives: list = field(default_factory=list)    # per emitted token, when params.top_logprobs
    pending_alternatives: list | None = None            # the next emit's (set where its logprobs are)
    finish_reason: str = ""                             # "stop" (end id or stop word) or "length"
    ended_at_end_id: bool = False                       # the last output is an end id (its text is not sent)
    admitted_ns: int = 0                                # wall clock when a batch took it (serving)
    request_id: int = -1
    on_tokens: object = None                            # the scheduler's callback for this request
    acceptance: AcceptanceTracker | None = None         # set by a speculative group
    adaptive_k: int = 0                                 # its K this step (--draft_len_adaptive)
    stepped: bool = False                               # past its first speculative step in a group

    def emit(self, tokens, logprobs=None) -> list[int]:
        """Appends tokens (and their log-probabilities, if given) up to the first that finishes it."""
        kept = []
        for t in tokens:
            self.outputs.append(t)
            kept.append(t)
            if t in self.end_ids or any(self._ends_with(s) for s in self.stop_words if s):
                self.finished, self.finish_reason, self.ended_at_end_id = True, "stop", t in self.end_ids
                break
            if len(self.outputs) >= self.max_new_tokens:
                self.finished, self.finish_reason = True, "length"
                break
        if logprobs:
            self.logprobs.extend(logprobs[:len(kept)])
        if self.pending_alternatives is not None:
            self.alternatives.extend(self.pending_alternatives[:len(kept)])
            self.pending_alternatives = None
        return kept

    def _ends_with(self, word) -> bool:
        """The sequence, prompt included, ends with ``word``: a stop word may begin in the prompt, as
        TensorRT-LLM's stop criterion reads the whole sequence (and bad words here do)."""
        n = len(word)
        if len(self.outputs) >= n:
            return self.outputs[-n:] == list(word)
        before = n - len(self.outputs)
        return len(self.prompt) >= before and list(self.prompt[-before:]) + self.outputs == list(word)

    @property
    def mean_accepted_tokens(self) -> float:
        total = sum(self.gained.values())
        return sum(n * c for n, c in self.gained.items()) / total if total else 0.0

    def speculation_stats(self, k: int = 0) -> dict:
        """This sequence's verify steps, draft tokens proposed and accepted, and the histogram of
        accepted drafts per step (index j: steps that kept exactly j drafts), at least ``k`` + 1
        buckets (its K: a client reads K from the length, as from the OpenAI frontend's)."""
        steps = sum(self.gained.values())
        accepted = sum((n - 1) * c for n, c in self.gained.items())
        top = max(self.gained, default=1)
        top = max(top, k + 1)
        return {"steps": steps, "draft_tokens": self.drafted, "accepted_draft_tokens": accepted,
                "histogram": [self.gained.get(j + 1, 0) for j in range(top)]}


def _logprobs(logits, tokens, seqs, raw=None) -> list:
    """Per sequence: log-probabilities of its tokens (None for those that did not ask); a sequence
    that asked for alternatives gets them as its next emit's ``pending_alternatives``. ``raw``: the
    same rows before shaping, which a sequence asking for ``raw_logprobs`` reads instead."""
    if not any(s.params.logprobs for s in seqs):
        return [None] * len(seqs)
    params = [s.params for s in seqs]
    if raw is not None and any(p.raw_logprobs for p in params):
        logits = torch.stack([r if p.raw_logprobs else x for x, r, p in zip(logits, raw, params)])
    if any(p.top_logprobs for p in params):
        for s, top in zip(seqs, top_logprobs(logits, params)):
            s.pending_alternatives = top
    return [lp or None for lp in token_logprobs(logits, tokens, params)]


def _rows(state: dict, index) -> dict:
    index = torch.as_tensor(index, dtype=torch.long)
    return {k: v[index.to(v.device)] for k, v in state.items()}


def _cat(a: dict, b: dict) -> dict:
    return {k: torch.cat([a[k], b[k]]) for k in a}


class PlainGroup:
    """Target-only sequences: one token per sequence per step."""

    features = ()

    def __init__(self, target, capacity: int, prefill_chunk: int = 512):
        self.target, self.capacity, self.prefill_chunk = target, capacity, prefill_chunk
        self.seqs: list[Sequence] = []
        self.state = None
        self.forwards = 0
        self.costs = StepCosts()
        self.steps = 0              # decode / verify steps so far
        self.trace = None           # speculation trace sink: called with one dict per step per sequence

    def _prefill(self, seqs):
        state = self.target.new_state(len(seqs), self.capacity)
        logits, state, forwards, features = prefill(self.target, [s.prompt for s in seqs], state,
                                                    self.prefill_chunk, self.features)
        self.forwards += forwards
        raw, logits = logits[:, None], shape(logits[:, None], seqs)[:, 0]
        first, _ = draw(logits, [s.params for s in seqs])
        logprobs = _logprobs(logits[:, None], first[:, None], seqs, raw)
        emitted = []
        for s, t, lp in zip(seqs, first.tolist(), logprobs):
            s.position, s.last = len(s.prompt), t
            emitted.append(s.emit([t], lp))
        return state, features, emitted

    def add(self, seqs: list[Sequence]) -> list[list[int]]:
        """Prefills newcomers and merges them into the batch; returns each one's first token(s)."""
        state, _, emitted = self._prefill(seqs)
        self._merge(seqs, state)
        return emitted

    def _merge(self, seqs, state, *_):
        self.state = state if not self.seqs else _cat(self.state, state)
        self.seqs += seqs

    def step(self) -> list[list[int]]:
        """One decode step for every sequence; returns the tokens each one gained."""
        return self._decode_step(Stopwatch())

    def _decode_step(self, watch, on_features=None):
        """Decodes one token per sequence; ``on_features(tokens, features)`` runs (timed as draft
        work) before the tokens are emitted."""
        dev = self.target.device
        n = len(self.seqs)
        ids = torch.tensor([[s.last] for s in self.seqs], dtype=torch.int32, device=dev)
        pos = torch.tensor([[s.position] for s in self.seqs], dtype=torch.int32, device=dev)
        watch.lap()
        logits, self.state, features = self.target.forward(ids, pos, torch.ones(n, dtype=torch.int32, device=dev),
                                                            torch.zeros(n, 1, dtype=torch.int32, device=dev), self.state)
        decode = watch.lap()
        self.forwards += 1
        self.steps += 1
        raw = logits[:, :1]
        logits = shape(raw, self.seqs)
        tokens, _ = draw(logits[:, 0], [s.params for s in self.seqs])
        logprobs = _logprobs(logits, tokens[:, None], self.seqs, raw)
        draft = 0.0
        if on_features is not None:
            watch.lap()
            on_features(tokens, features)
            draft = watch.lap()
        out = []
        for s, t, lp in zip(self.seqs, tokens.tolist(), logprobs):
            out.append(s.emit([t], lp))
            if self.trace is not None:
                self._trace(s, 0, [], 0, t, out[-1], draft, decode)
            s.position, s.last = s.position + 1, t
        self.costs.add(watch.total(), tokens=n, rows=n, draft=draft, verify=decode)
        return out

    def _trace(self, s, k, proposed, accepted, bonus, emitted, draft, verify, **extra):
        self.trace({"step": self.steps, "sequence": s.request_id, "position": s.position, "k": k,
                    "proposed": proposed, "accepted": accepted, "bonus": bonus, "emitted": len(emitted),
                    "draft_ms": round(draft * 1e3, 3), "verify_ms": round(verify * 1e3, 3), **extra})

    def drop(self, keep: list[int]):
        """Keeps the sequences at these indices (finished or cancelled ones leave)."""
        self.seqs = [self.seqs[i] for i in keep]
        self.state = _rows(self.state, keep) if keep else None


class SpeculativeGroup(PlainGroup):
    """Sequences decoded with a draft: one verify per step, K proposals per sequence."""

    def __init__(self, target, make_proposer, draft_len: int, capacity: int, prefill_chunk: int = 512,
                 policy: DraftPolicy | None = None, trace=None):
        super().__init__(target, capacity, prefill_chunk)
        self.trace = trace
        self.make_proposer, self.draft_len = make_proposer, draft_len
        self.policy = policy or DraftPolicy(draft_len)
        self.target_only_steps = 0
        self.draft_lens = Counter()          # steps by the K they verified (0: a target-only step)
        self.proposer = None
        self.verifies = 0
        self.histogram = Counter()
        self.draft_tokens = 0                # proposed over all verify rows
        self.accepted_at = Counter()         # draft position j (0-based) -> rows that accepted it
        self.step_costs = StepCostTable() if self.policy.adaptive else None   # --draft_len_adaptive
        self.position_factors = PositionFactors() if self.policy.adaptive else None

    @property
    def draft_seconds(self) -> float:
        return self.costs.draft

    @property
    def verify_seconds(self) -> float:
        return self.costs.verify

    def add(self, seqs):
        proposer = self.make_proposer()
        self.features = proposer.features
        state, features, emitted = self._prefill(seqs)
        for s in seqs:
            s.acceptance = AcceptanceTracker(self.policy)
        proposer.start([s.prompt for s in seqs], [s.last for s in seqs], features, self.capacity)
        if self.proposer is None or not self.seqs:
            self.proposer = proposer
        else:
            self.proposer.merge(proposer)
        self._merge(seqs, state)
        return emitted

    def _draft_len(self) -> int:
        """The step's K: the most any speculating sequence drafts (a sequence under the acceptance
        floor, or asking K = 0, drafts nothing, so it no longer makes the others draft for it)."""
        n = len(self.seqs)
        drafting = [s for s in self.seqs if s.acceptance.speculating]
        if not drafting:
            return 0
        k = min(self.draft_len, self.policy.k_for_batch(n), self.capacity - 1 - max(s.position for s in self.seqs),
                max(self.draft_len if s.max_draft is None else s.max_draft for s in drafting))
        if k > 0 and self.step_costs is not None:   # each sequence's own K from its acceptance; the step drafts the most
            candidates = candidate_lengths(k, getattr(self.target, "verify_buckets", ()))
            for s in self.seqs:
                own = k if s.max_draft is None else min(k, s.max_draft)
                rates = sequence_rates(s.acceptance.rate.rate, self.position_factors, k)
                s.adaptive_k = best_length(rates, [c for c in candidates if c <= own] or [own],
                                           lambda kk: self.step_costs.cost(n, kk))
            k = max(s.adaptive_k for s in drafting)
        return k

    def _own_k(self, s: Sequence, k: int) -> int:
        """A sequence's K this step: the step's, capped by its request's and its adaptive choice."""
        if s.max_draft is not None:
            k = min(k, s.max_draft)
        return k if self.step_costs is None else min(k, s.adaptive_k)

    def _target_only_step(self, watch):
        """K = 0 (the batch-size schedule, or no sequence speculating): a plain decode step whose
        token and features the draft queues for its next proposal."""
        n = len(self.seqs)
        self.target_only_steps += 1
        self.draft_lens[0] += 1
        return self._decode_step(watch, lambda tokens, features: self.proposer.accept(
            torch.zeros(n, dtype=torch.long), tokens, torch.zeros(n, 0, dtype=torch.long), features))

    def _verify_width(self, k: int, width: int) -> int:
        """Drafts verified by a step whose confident drafts were ``k`` of ``width``: ``k``, or where
        the target runs compiled verify steps for some lengths only (``verify_buckets``, in tokens)
        and k + 1 is not one, the longest shorter one; a length between two buckets would run padded
        to the next (``CompiledRunner.verify_greedy``), paying its rows for fewer drafts."""
        buckets = getattr(self.target, "verify_buckets", None)
        if k >= width or not buckets or k + 1 in buckets:
            return k
        return max((b - 1 for b in buckets if b - 1 <= k), default=k)

    def step(self):
        watch = Stopwatch()
        k = self._draft_len()
        if k == 0:
            return self._target_only_step(watch)
        dev = self.target.device
        n = len(self.seqs)
        steady = all(s.stepped for s in self.seqs)    # a newcomer's first step also drafts over its prompt
        params = [s.params for s in self.seqs]
        caps = [self._own_k(s, k) if s.acceptance.speculating else 0
                for s in self.seqs]   # each row's own K: its draws past it would not be verified
        drafts, q, conf = self.proposer.propose(k, params, self.policy.confidence_threshold, caps)
        # per sequence, how many drafts it verifies: its confident prefix, 0 once its acceptance
        # fell under the floor, at most its own K (Python ints: a handful per step)
        width = drafts.shape[1]
        confident = self.policy.confident_lengths(conf).tolist() if conf is not None else [width] * n
        proposed = [min(c if s.acceptance.speculating else 0, self._own_k(s, k))
                    for c, s in zip(confident, self.seqs)]
        k = self._verify_width(max(proposed), width)
        proposed = [min(p, k) for p in proposed]
        drafted = drafts.tolist()
        drafts, q = drafts[:, :k], None if q is None else q[:, :k]
        draft = watch.lap()
        ids = torch.tensor([[s.last] + d[:k] for s, d in zip(self.seqs, drafted)], dtype=torch.int32, device=dev)
        pos = torch.tensor([range(s.position, s.position + k + 1) for s in self.seqs], dtype=torch.int32, device=dev)
        rows = torch.tensor([range(k + 1)] * n, dtype=torch.int32, device=dev)
        lengths = torch.full((n,), k + 1, dtype=torch.int32, device=dev)
        watch.lap()
        limit = None if all(p == k for p in proposed) else torch.tensor(proposed)
        if hasattr(self.target, "verify_greedy") and all(p.plain_greedy for p in params):
            # plain greedy rows: verify, accept and roll back in one call (accept time is in verify); a
            # row that verifies fewer drafts than the step (its own K, a confidence stop, a row under
            # the acceptance floor) has the rest as padding past its length, which caps its accept
            own = lengths if limit is None else (limit + 1).to(lengths.dtype).to(dev)
            m, nxt, logits, self.state, features = self.target.verify_greedy(ids, pos, own, rows, self.state)
            verify, accept, raw = watch.lap(), 0.0, None   # unshaped: the raw rows themselves
        else:
            raw, new_state, features = self.target.forward(ids, pos, lengths, rows, self.state, verify=True)
            verify = watch.lap()
            logits = shape(raw, self.seqs, drafts)
            m, nxt = acceptance.accept(drafts.to(logits.device), q, logits, params, limit)
            self.state = self.target.rollback(self.state, new_state, m.to(dev))
            accept = watch.lap()
        self.proposer.accept(m, nxt, drafts, features)
        draft += watch.lap()
        self.verifies += 1
        self.forwards += 1
        self.steps += 1
        self.draft_lens[k] += 1
        out, tokens = [], 0
        want_logprobs = any(p.logprobs for p in params)
        for b, (s, d, kept, t, made) in enumerate(zip(self.seqs, drafted, m.tolist(), nxt.tolist(), proposed)):
            gained = d[:kept] + [t]                                      # one host copy of each tensor
            lp = _logprobs(logits[b:b + 1, :kept + 1], torch.tensor([gained]), [s],
                           None if raw is None else raw[b:b + 1, :kept + 1])[0] if want_logprobs else None
            if made:   # a row that proposed nothing (its own K is 0) decoded: not a speculative step
                s.gained[len(gained)] += 1
                self.histogram[len(gained)] += 1
            s.drafted += made
            self.draft_tokens += made
            for j in range(kept):
                self.accepted_at[j] += 1
            s.acceptance.record(kept, made)
            s.stepped = True
            if self.position_factors is not None:
                self.position_factors.record(kept, made)
            out.append(s.emit(gained, lp))
            tokens += len(out[-1])        # emitted: the last step's run past max_new_tokens or an end id is cut
            if self.trace is not None:
                self._trace(s, made, d[:made], kept, t, out[-1], draft, verify)
            s.position, s.last = s.position + len(gained), t
        seconds = watch.total()
        self.costs.add(seconds, tokens=tokens, rows=n, proposals=sum(proposed), draft=draft,
                       verify=verify, accept=accept)
        if self.step_costs is not None and steady:   # a prompt's catch-up is not what a step at k costs
            self.step_costs.record(n, k, seconds)
        return out

    def drop(self, keep):
        super().drop(keep)
        if keep:
            self.proposer.keep(torch.tensor(keep, dtype=torch.long))
        else:
            self.proposer = None
