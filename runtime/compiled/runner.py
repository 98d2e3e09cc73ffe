"""The compiled CPU path: the runtime's fixed-shape steps through ``torch.compile``, the rest eager.

A small model on the CPU spends most of a step in per-op dispatch, not in its math. The steps the
runtime repeats have few shapes: decode (T=1), verify (T=K+1), the target's rollback after a verify,
a feature draft's proposal row (T=1) and catch-up chunk (up to K+1 rows, padded to K+1). Each such
step, once it has run a couple of times, is compiled whole (``fullgraph``: the torch backend drops
its data-dependent branches under compilation, see ``builder.backends.torch_backend``) by inductor
with its C++ wrapper, captured once per shape key with ``aot_compile`` and called directly from
then on (``_Steps``). Long chunks and chunks of other lengths (a prompt's prefill, a draft's prompt
context) always run eagerly: a prompt length recurs only when the same prompts are run again and
again, and compiling one then stalled that run for seconds (11 s for an eagle3 draft's 11-row prompt,
mid-benchmark).

Shapes: the chunk length T is static (one graph per T); the batch dimension is static at 1 (the
latency case) and dynamic for 2 and more (one graph for every larger batch, measured as fast as
static ones); the KV-cache capacity dimension is dynamic, so a new ``generate`` (whose capacity is
prompt + max_new_tokens + K + 1) reuses the graphs. ``new_state`` allocates ``HEADROOM`` slots past
the capacity asked for, so padded rows of a compiled chunk never write past the cache.

The compile cost is paid once per graph and machine: inductor's caches live under
``$NEMOSPEC_COMPILE_CACHE`` (default ``~/.cache/nemospec/inductor``), and a graph already there
takes seconds to load in a new process instead of tens of seconds to build. Each compile prints
one line to stderr. A step that fails to compile (a graph break in a model this path does not
know) runs eagerly from then on, with one warning.
"""
from __future__ import annotations

import functools
from dataclasses import replace
import time

import torch

from builder.backends import torch_backend
from runtime.acceptance import greedy
from runtime.compiled.draft import CompiledDraft
from runtime.compiled.shapes import (HEADROOM, MAX_TOKENS, PROMPT_COMPILED_MAX, PROMPT_ROWS, STEP_CALLS, _batch_label,
                                     _dims, _pad_rows, _prepare)
from runtime.compiled.steps import _Steps, cache_dir, device_options, product_form, stop_compiling
from runtime.runner import TorchRunner, verify_greedy, verify_tree_greedy


class CompiledRunner(TorchRunner):
    """A NemotronH (target, or a draft_target draft) with its short steps compiled.

    Same interface and outputs as ``TorchRunner``; decode, verify (at most ``MAX_TOKENS`` tokens),
    ``rollback`` and warmed chunk lengths (``warm``) run compiled from their second call, a prompt's
    prefill eagerly. A verify chunk
    of T tokens is padded to the next of ``verify_buckets`` (2, 3, 5, 9 and K+1): a draft length
    that changes per step (adaptive K) then reuses a few graphs. Padded rows are right padding
    past ``lengths`` (as in a ragged batch): their logits and features are cut off, and the
    rollback never reaches them (it keeps at most ``lengths`` rows). Everything runs under
    ``no_grad``, not ``inference_mode``: graph guards tell inference tensors from the ordinary
    ones ``new_state`` allocates, and a mix would compile every step twice."""

    def __init__(self, module, device="cpu", max_draft_len: int = 4, weight_dtype: str = "auto",
                 matmul_precision: str = "highest", role: str = "target"):
        super().__init__(module, device)
        self.verify_buckets = sorted(t for t in {2, 3, 5, 9, max_draft_len + 1} if 1 < t <= MAX_TOKENS)
        self.step_chunks = {2}     # chunk lengths compiled as steps (2nd call), not as other short chunks
        self.capacity_dims = _dims(module.state_spec)
        # --matmul_precision, and a draft_target draft's --draft_weight_dtype
        self.product_form = product_form(weight_dtype, matmul_precision)
        # a draft_target draft (``role="draft"``) labels its steps "draft decode step (batch 1)" etc.
        steps = functools.partial(_Steps, product_form=self.product_form, options=device_options(device),
                                  label_prefix="" if role == "target" else f"{role} ")
        self._forward = steps(module.forward, f"{role} forward")
        self._rollback = steps(module.rollback, f"{role} rollback") if hasattr(module, "rollback") else None
        self._tree_rollback = steps(module.tree_rollback, f"{role} tree rollback")
        self._verify_greedy = steps(functools.partial(verify_greedy, module), f"{role} greedy verify")
        self._verify_tree_greedy = steps(functools.partial(verify_tree_greedy, module), f"{role} greedy tree verify")

    def new_state(self, batch, capacity):
        return super().new_state(batch, capacity + HEADROOM)

    def prefills_alone(self, prompt, chunk_size: int) -> bool:
        """Whether ``runtime.prefill`` should feed this prompt of a batch alone: on a CPU, when it fits
        the compiled prompt chunks (``_prompt_chunks``: batch 1 only), which a batch's chunk would run
        eagerly. A GPU runs a batch's eager chunk at once (one prompt at a time would be launch-bound)."""
        return torch.device(self.device).type == "cpu" and 0 < len(prompt) <= min(PROMPT_COMPILED_MAX, chunk_size)

    @torch.no_grad()
    def forward(self, input_ids, positions, lengths, logit_index, state, verify=False, tree=None):
        batch, tokens = input_ids.shape
        if tree is not None:  # a tree verify: one graph per tree size
            key = (batch == 1, tokens, "tree")
            args = [_prepare(a, batch, {}) for a in (input_ids, positions, lengths, logit_index)]
            return self._forward(key, f"tree verify ({tokens} rows, {_batch_label(batch)})", STEP_CALLS, *args,
                                 _prepare(state, batch, self.capacity_dims), verify=verify,
                                 tree=tuple(_prepare(t, batch, {}) for t in tree))
        if (not verify and batch == 1 and 1 < tokens <= PROMPT_COMPILED_MAX and tokens not in self.step_chunks
                and logit_index.shape[1] == 1 and int(lengths[0]) == tokens):
            return self._prompt_chunks(input_ids, positions, lengths, logit_index, state)
        if tokens > MAX_TOKENS:
            return self._eager(input_ids, positions, lengths, logit_index, state, verify)
        pad = tokens
        if verify:   # the next bucket (after the warm-up: the next warmed one), else unpadded
            rows = logit_index.shape[1]   # logit rows that cover every row cover the padding too
            pad = self._forward.first_compiled((b for b in self.verify_buckets if b >= tokens),
                                               lambda b: (batch == 1, b, b if rows == tokens else rows, True)) or tokens
        if pad > tokens:
            return self._padded_verify(input_ids, positions, lengths, logit_index, state, pad)
        key = (batch == 1, tokens, logit_index.shape[1], bool(verify))
        if verify:
            label, calls = f"verify step ({tokens} tokens, {_batch_label(batch)})", STEP_CALLS
        elif tokens == 1:
            label, calls = f"decode step ({_batch_label(batch)})", STEP_CALLS
        elif tokens in self.step_chunks:  # a draft_target draft's queued rows (``warm``), prompt rows
            label, calls = f"{tokens}-token chunk ({_batch_label(batch)})", STEP_CALLS
        else:   # a prompt's prefill
            return self._eager(input_ids, positions, lengths, logit_index, state, verify)
        args = [_prepare(a, batch, {}) for a in (input_ids, positions, lengths, logit_index)]
        return self._forward(key, label, calls, *args, _prepare(state, batch, self.capacity_dims), verify=verify)

    def _eager(self, *args):
        """A chunk no graph serves (a long prompt's prefill), run eagerly in the steps' precision."""
        with torch_backend.product_form(self.product_form):
            return self.module.forward(*args)

    def _prompt_chunks(self, input_ids, positions, lengths, logit_index, state):
        """One sequence's short prompt chunk as compiled chunks of PROMPT_ROWS rows, the last
        right-padded past ``lengths`` (as a ragged batch pads a shorter sequence). Batch 1 only: a
        server admits the requests that arrived since its last step, one at a time unless they came
        in a burst, and each batch-2+ graph is ~40 s more to compile once.
        Returns what ``forward`` does: the last row's logits, the state, every real row's features."""
        tokens = input_ids.shape[1]
        self.step_chunks.add(PROMPT_ROWS)
        width = -(-tokens // PROMPT_ROWS) * PROMPT_ROWS
        rows = _pad_rows({"input_ids": input_ids, "positions": positions}, 1, tokens, width)
        index = int(logit_index[0, 0])
        logits, features = None, []
        for start in range(0, width, PROMPT_ROWS):
            real = min(PROMPT_ROWS, tokens - start)
            out, state, feats = self.forward(
                rows["input_ids"][:, start:start + PROMPT_ROWS], rows["positions"][:, start:start + PROMPT_ROWS],
                torch.full_like(lengths, real), torch.full_like(logit_index, min(max(index - start, 0), PROMPT_ROWS - 1)),
                state)
            if start <= index < start + PROMPT_ROWS:
                logits = out
            features.append(feats)
        features = {k: torch.cat([f[k] for f in features], 1)[:, :tokens] for k in features[0]}
        return logits, state, features

    @torch.no_grad()
    def verify_greedy(self, input_ids, positions, lengths, logit_index, state):
        """Verify + greedy accept + rollback as one graph per chunk length. A length between buckets
        (K = 3 where the engine's K is 4) is right-padded to the next bucket past ``lengths`` (after a
        server's warm-up, the next one warmed), which caps the accept at the real drafts; one with
        fewer logit rows, or past every bucket, runs the three as separate steps."""
        batch, tokens = input_ids.shape
        pad = self._verify_greedy.first_compiled((b for b in self.verify_buckets if b >= tokens),
                                                 lambda b: (batch == 1, b))
        if pad is None or logit_index.shape[1] != tokens:
            logits, verified, features = self.forward(input_ids, positions, lengths, logit_index, state, verify=True)
            m, nxt = greedy(input_ids[:, 1:].long(), logits, lengths - 1)   # a row's rows past its length: padding
            return m, nxt, logits, self.rollback(state, verified, m), features
        input_ids, positions, logit_index = _padded_verify_feeds(input_ids, positions, logit_index, pad)
        m, nxt, logits, state, features = self._verify_greedy(
            (batch == 1, pad), f"greedy verify step ({pad} tokens, {_batch_label(batch)})", STEP_CALLS,
            *(_prepare(a, batch, {}) for a in (input_ids, positions, lengths, logit_index)),
            _prepare(state, batch, self.capacity_dims))
        return m, nxt, logits[:, :tokens], state, _unpadded_features(features, tokens, pad)

    @torch.no_grad()
    def verify_tree_greedy(self, input_ids, positions, state, parents, base, depth):
        """Tree verify + greedy accept + tree rollback as one graph per (tree size, depth)."""
        batch, size = input_ids.shape
        return self._verify_tree_greedy((batch == 1, size, depth), f"greedy tree verify ({size} rows, {_batch_label(batch)})",
                                        STEP_CALLS, *(_prepare(a, batch, {}) for a in (input_ids, positions)),
                                        _prepare(state, batch, self.capacity_dims),
                                        *(_prepare(a, batch, {}) for a in (parents, base)), depth)

    def _padded_verify(self, input_ids, positions, lengths, logit_index, state, pad):
        tokens, rows = input_ids.shape[1], logit_index.shape[1]
        input_ids, positions, logit_index = _padded_verify_feeds(input_ids, positions, logit_index, pad)
        logits, new_state, features = self.forward(input_ids, positions, lengths, logit_index, state, verify=True)
        return logits[:, :rows], new_state, _unpadded_features(features, tokens, pad)

    @torch.no_grad()
    def tree_rollback(self, state, verified, paths, lengths, base):
        batch = paths.shape[0]
        tokens = max((v.shape[1] for k, v in verified.items() if k not in self.capacity_dims and v.dim() > 1),
                     default=0)
        key = (batch == 1, tokens, paths.shape[1])
        return self._tree_rollback(key, f"tree rollback ({tokens} rows, {_batch_label(batch)})", STEP_CALLS,
                                   _prepare(state, batch, self.capacity_dims), _prepare(verified, batch, self.capacity_dims),
                                   *(_prepare(t, batch, {}) for t in (paths, lengths, base)))

    def warm(self, tokens: int, batch: int = 1) -> None:
        """Runs a ``tokens``-token chunk on a scratch state until its graph is compiled (or loaded
        from the cache), and counts that length as a step from now on: for a step shape that a short
        warm-up run may never repeat often enough, such as a draft_target draft's 2-token chunk,
        queued only after a fully accepted step, or the 1..depth+1 rows it queues after tree steps
        (which would otherwise compile as other short chunks, on their 16th call, mid-run)."""
        self.step_chunks.add(tokens)
        state, ids, positions, lengths = self._scratch_chunk(tokens, batch)
        for _ in range(STEP_CALLS):
            self.forward(ids, positions, lengths, (lengths - 1)[:, None], state)

    def warm_verify(self, tokens: int, batch: int = 1) -> None:
        """Runs the greedy verify of a ``tokens``-token chunk on a scratch state until its graph is
        compiled (or loaded): the shorter verify lengths a confidence stop trims a step to, which a
        short warm-up run may not meet twice."""
        state, ids, positions, lengths = self._scratch_chunk(tokens, batch)
        for _ in range(STEP_CALLS):
            self.verify_greedy(ids, positions, lengths, positions.contiguous(), state)

    def warm_sampled_verify(self, tokens: int, batch: int = 1) -> None:
        """Runs the verify forward and the rollback of a ``tokens``-token chunk on a scratch state until
        their graphs are compiled (or loaded): a sampled step a confidence stop trims to a shorter
        length verifies through these, not the greedy graph."""
        state, ids, positions, lengths = self._scratch_chunk(tokens, batch)
        accepted = torch.zeros(batch, dtype=torch.long, device=self.device)
        for _ in range(STEP_CALLS):
            _, verified, _ = self.forward(ids, positions, lengths, positions.contiguous(), state, verify=True)
            state = self.rollback(state, verified, accepted)

    def _scratch_chunk(self, tokens: int, batch: int):
        """A scratch state and a ``tokens``-token chunk of zeros at positions 0.. for each sequence."""
        ids = torch.zeros(batch, tokens, dtype=torch.int32, device=self.device)
        positions = torch.arange(tokens, dtype=torch.int32, device=self.device).expand(batch, -1)
        lengths = torch.full((batch,), tokens, dtype=torch.int32, device=self.device)
        return self.new_state(batch, 2 * MAX_TOKENS), ids, positions, lengths

    @torch.no_grad()
    def rollback(self, state, verified, accepted_rows):
        if self._rollback is None:
            return super().rollback(state, verified, accepted_rows)
        batch = accepted_rows.shape[0]
        tokens = max((v.shape[1] for k, v in verified.items() if k not in self.capacity_dims and v.dim() > 1),
                     default=0)
        key = (batch == 1, tokens)
        return self._rollback(key, f"rollback ({tokens} tokens, {_batch_label(batch)})", STEP_CALLS,
                              _prepare(state, batch, self.capacity_dims), _prepare(verified, batch, self.capacity_dims),
                              _prepare(accepted_rows, batch, {}))


def warm_up(loaded, prompts, draft_len: int = 0, tree=None, policy=None, **generate_args) -> float:
    """A short greedy run of ``prompts`` (speculative with ``draft_len`` > 0, with token trees of
    shape ``tree`` if given, then target-only on the same prompts, as the CLI's cost line runs it) so
    that the steps a timed run of them uses are compiled, or loaded from the cache, before it starts.
    ``policy``: the run's draft policy (default ``loaded.draft_policy``): a confidence stop verifies
    shorter chunks, whose buckets are warmed too, and an adaptive K (each of its candidate lengths) or
    a ``--draft_len_schedule`` (its K for each batch size) drafts other lengths, warmed as runs of
    their own. Several prompts are warmed as a batch and, first, the first alone (the batch's tail).
    Returns the seconds it took (0 when ``loaded`` is not on the compiled path)."""
    if not isinstance(loaded.runner, CompiledRunner):
        return 0.0
    # a batch's sequences finish at different steps, so its last one runs alone: batch 1 first
    return sum(_warm_batch(loaded, batch, draft_len, tree, policy, **generate_args)
               for batch in ([prompts[:1], prompts] if len(prompts) > 1 else [prompts]))


def _warm_batch(loaded, prompts, draft_len: int, tree, policy, **generate_args) -> float:
    """``warm_up`` at one batch size (``prompts`` as one batch); returns the seconds it took."""
    from runtime.generation import generate
    start = time.perf_counter()
    if draft_len > 0:
        _warm_speculative(loaded, prompts, draft_len, tree, **generate_args)
        policy = policy if policy is not None else getattr(loaded, "draft_policy", None)
        if tree is None and policy is not None and policy.confidence_threshold:   # steps trimmed to fewer drafts,
            for tokens in loaded.runner.verify_buckets:    # and the whole K, which a warm-up trimming every step misses
                if tokens <= draft_len + 1:                # (a sampled step's: its verify forward and rollback)
                    loaded.runner.warm_verify(tokens, len(prompts))
                    if generate_args.get("temperature"):
                        loaded.runner.warm_sampled_verify(tokens, len(prompts))
        if tree is None and policy is not None:   # the other K an adaptive K or a schedule by batch size drafts
            for k in sorted(_other_lengths(loaded, policy, draft_len), reverse=True):
                _warm_speculative(loaded, prompts, k, None, **generate_args)
    # a prompt chunk compiles (or loads) on its STEP_CALLS-th call: the speculative run above made one,
    # so a target-only warm-up prefills that often itself (one prefill loaded its chunk in the timed run)
    for _ in range(STEP_CALLS - 1 if draft_len > 0 else STEP_CALLS):
        generate(loaded.runner, prompts, STEP_CALLS + 2, **generate_args)
    return time.perf_counter() - start


def _other_lengths(loaded, policy, draft_len: int) -> set:
    """The draft lengths besides ``draft_len`` that ``policy`` makes steps draft: an adaptive K's
    candidates, and a ``--draft_len_schedule``'s K for other batch sizes (a batch shrinks as its
    sequences finish)."""
    from runtime.adaptive_draft_len import candidate_lengths
    from runtime.draft_len import scheduled_lengths
    lengths = set(candidate_lengths(draft_len, loaded.runner.verify_buckets)) if policy.adaptive else set()
    lengths.update(scheduled_lengths(policy.schedule, draft_len) if policy.schedule else ())
    return lengths - {draft_len, 0}


def _warm_speculative(loaded, prompts, draft_len: int, tree, **generate_args) -> None:
    """``warm_up``'s speculative part at one K: a run, then every catch-up bucket of the draft."""
    from runtime.speculative import speculative_generate
    steps = STEP_CALLS + 2
    proposer = loaded.proposer()
    speculative_generate(loaded.runner, proposer, prompts, steps * (draft_len + 1), draft_len, tree=tree,
                         **generate_args)   # at draft_len itself: a policy's schedule must not change it
    if isinstance(getattr(proposer, "draft", None), CompiledDraft):
        if tree is None:
            proposer.draft.warm_chain(draft_len, len(prompts))
        else:
            proposer.draft.warm_steps(len(prompts))
    draft = getattr(proposer, "runner", None)          # a draft_target draft: a NemotronH of its own
    if isinstance(draft, CompiledRunner):              # [last draft, bonus], queued after a full accept;
        for tokens in range(2, 2 + (tree.depth if tree is not None else 1)):   # after a tree: 1..depth+1 rows
            draft.warm(tokens, len(prompts))


# `nemospec serve --warm_up`: what a server compiles before it is ready (requests outside run eagerly)
SERVING_WARM_UPS = {"all": dict(sampled=True, batched=True),       # greedy and sampled, one sequence and batches
                    "greedy": dict(sampled=False, batched=True),   # about half the first-time compile
                    "single": dict(sampled=False, batched=False)}  # greedy, one sequence: about a quarter


def warm_up_for_serving(loaded, draft_len: int, log=None, sampled: bool = True, batched: bool = True,
                        also=(), reopen: dict | None = None) -> float:
    """What a server's requests run, compiled (or loaded from the cache) before it reports ready:
    greedy and (with ``sampled``) sampled, one sequence and (with ``batched``) two (batch 1 and the
    batch-2+ graphs), speculative at ``draft_len``, at each length in ``also`` and at those the
    loaded draft policy's adaptive K or ``--draft_len_schedule`` uses, and target-only; then
    ``stop_compiling`` (what was not warmed runs eagerly: exact, slower, and counted:
    ``steps.EAGER_AFTER_WARM_UP``). ``reopen``: how the server opened its engine directory
    (``runtime.compiled.warm_helpers.start``), for helper processes that compile the same steps beside
    it. Returns the seconds it took (0 off the compiled path)."""
    if not isinstance(loaded.runner, CompiledRunner):
        return 0.0
    policy = getattr(loaded, "draft_policy", None)
    if draft_len > 0 and policy is not None:   # every K a sequence may pick, or its batch size gives it
        also = (*also, *_other_lengths(loaded, policy, draft_len))
    units = [[k, batch, sampling] for k in (sorted({draft_len, *also}, reverse=True) if draft_len > 0 else [0])
             for batch in (1, 2)[:2 if batched else 1] for sampling in (False, True)[:2 if sampled else 1]]
    if draft_len > 0:   # target-only requests (speculative: false), batched with others if batched
        units.append([0, 2 if batched else 1, False])
    from runtime.compiled import warm_helpers
    # on a GPU the helpers' copies of the weights would take the device's memory: none there
    helpers = (warm_helpers.start(reopen, units, log)
               if reopen is not None and torch.device(loaded.runner.device).type == "cpu" else [])
    try:
        seconds, policy = 0.0, serving_policy(loaded)
        for unit in units:
            seconds += serving_unit(loaded, unit, policy)
            if log is not None:
                k, batch, sampling = unit
                log(f"warm-up: {f'K={k}' if k else 'target-only'}, batch {batch}, "
                    f"{'sampled' if sampling else 'greedy'}: {seconds:.1f} s so far")
    finally:
        warm_helpers.stop(helpers, cache_dir())
    stop_compiling()
    return seconds


def serving_policy(loaded):
    """The draft policy the serving warm-up runs its units under: each K is a unit of its own, so
    neither an adaptive K nor a schedule changes the K a unit drafts."""
    policy = getattr(loaded, "draft_policy", None)
    return replace(policy, adaptive=False, schedule={}) if policy is not None else None


_PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]


def serving_unit(loaded, unit, policy) -> float:
    """One unit of the serving warm-up, ``[K, batch, sampled]`` (K 0: target-only); its seconds."""
    k, batch, sampling = unit
    return _warm_batch(loaded, _PROMPTS[:batch], k, None, policy if k else None, max_seq_len=loaded.max_seq_len,
                       **({"temperature": 0.8, "seed": 0} if sampling else {}))


def _padded_verify_feeds(input_ids, positions, logit_index, pad: int):
    """A verify chunk right-padded to ``pad`` rows past ``lengths`` (positions continue, ids are 0);
    logit rows that cover every row (the usual verify) cover the padded rows too, cut off after."""
    batch, tokens = input_ids.shape
    if pad == tokens:
        return input_ids, positions, logit_index
    feeds = _pad_rows({"input_ids": input_ids, "positions": positions}, batch, tokens, pad)
    if logit_index.shape[1] == tokens:
        logit_index = torch.cat([logit_index, logit_index[:, -1:] + torch.arange(
            1, pad - tokens + 1, dtype=logit_index.dtype, device=logit_index.device)], 1)
    return feeds["input_ids"], feeds["positions"], logit_index


def _unpadded_features(features: dict, tokens: int, pad: int) -> dict:
    """A padded verify's features cut back to its real rows."""
    if pad == tokens:
        return features
    return {k: v[:, :tokens] if v.dim() > 1 and v.shape[1] == pad else v for k, v in features.items()}
