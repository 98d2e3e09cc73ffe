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
import time

import torch

from builder.backends import torch_backend
from runtime.acceptance import greedy
from runtime.compiled.steps import _Steps, device_options, product_form, stop_compiling
from runtime.drafts import EagerDraft
from runtime.runner import TorchRunner, verify_greedy, verify_tree_greedy

HEADROOM = 16          # extra KV slots per sequence: the longest compiled chunk
MAX_TOKENS = 16        # chunks longer than this always run eagerly (prefill)
STEP_CALLS = 2         # decode, verify, rollback and draft rows compile on their 2nd call
# One sequence's prompt chunk of up to PROMPT_COMPILED_MAX tokens runs as compiled chunks of PROMPT_ROWS
# rows (the last right-padded): embedded target, 1 thread, eagerly ~4 ms + 0.1 ms a token (11 tokens 6.0 ms,
# 64: 10.2, 128: 17.3), compiled 2.2 ms per 16 rows (11 tokens: 2.2 ms); longer chunks stay eager.
PROMPT_ROWS, PROMPT_COMPILED_MAX = 16, 64
FEATURE_DRAFTS = ("eagle", "eagle3", "mtp")
BLOCK_DRAFTS = ("dflash", "dspark")      # context rows padded to K+1 by the proposer: one graph per step
PARALLEL_DRAFTS = ("peagle",)             # catch-up rows and placeholders right-padded to 2K: one graph per K
# Inductor turns a one-row attention (q [.., 1, D] x keys [.., D, S]) into a pointwise product and a
# sum, and by default recomputes q's rotary embedding (pow, cos, sin) inside it for every key slot.
# Storing such intermediates instead: embedded eagle3 draft step 0.50 -> 0.35 ms (the target's decode
# step unchanged, so it keeps the defaults).
DRAFT_OPTIONS = {"realize_cpu_opcount_threshold": 4, "realize_reads_threshold": 1}


def _dims(state_spec) -> dict[str, tuple[int, ...]]:
    """State name -> the dims that hold the capacity (from a symbolic ``state_spec``)."""
    try:
        spec = state_spec("batch", "capacity")
    except Exception:  # a module whose spec needs numbers: no dynamic capacity
        return {}
    return {name: tuple(i for i, d in enumerate(shape) if d == "capacity") for name, (shape, _) in spec.items()}


@functools.lru_cache(maxsize=1024)
def _dense_strides(shape) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _prepare(tree, batch: int, capacity_dims: dict):
    """Tensors with row-major strides (graph guards check strides, those of size-1 dims too, and a
    step leaves views such as a conv window), the batch dim marked dynamic for batch >= 2 and the
    capacity dims of known state names marked dynamic."""
    def one(name, t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.stride() != _dense_strides(tuple(t.shape)):
            t = t.clone(memory_format=torch.contiguous_format)
        if batch > 1 and t.dim() and t.shape[0] == batch:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for d in capacity_dims.get(name, ()):
            torch._dynamo.maybe_mark_dynamic(t, d)
        return t
    if isinstance(tree, dict):
        return {k: one(k, v) for k, v in tree.items()}
    return one(None, tree)


def _batch_label(batch: int) -> str:
    return "batch 1" if batch == 1 else "batch 2+"


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
                 matmul_precision: str = "highest"):
        super().__init__(module, device)
        self.verify_buckets = sorted(t for t in {2, 3, 5, 9, max_draft_len + 1} if 1 < t <= MAX_TOKENS)
        self.step_chunks = {2}     # chunk lengths compiled as steps (2nd call), not as other short chunks
        self.capacity_dims = _dims(module.state_spec)
        # --matmul_precision, and a draft_target draft's --draft_weight_dtype
        self.product_form = product_form(weight_dtype, matmul_precision)
        steps = functools.partial(_Steps, product_form=self.product_form, options=device_options(device))
        self._forward = steps(module.forward, "target forward")
        self._rollback = steps(module.rollback, "target rollback") if hasattr(module, "rollback") else None
        self._tree_rollback = steps(module.tree_rollback, "target tree rollback")
        self._verify_greedy = steps(functools.partial(verify_greedy, module), "target greedy verify")
        self._verify_tree_greedy = steps(functools.partial(verify_tree_greedy, module), "target greedy tree verify")

    def new_state(self, batch, capacity):
        return super().new_state(batch, capacity + HEADROOM)

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
        pad = next((b for b in self.verify_buckets if b >= tokens), tokens) if verify else tokens
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
        """Verify + greedy accept + rollback as one graph per chunk length (a length outside
        ``verify_buckets`` runs the three as separate steps)."""
        batch, tokens = input_ids.shape
        if tokens not in self.verify_buckets or logit_index.shape[1] != tokens:
            logits, verified, features = self.forward(input_ids, positions, lengths, logit_index, state, verify=True)
            m, nxt = greedy(input_ids[:, 1:].long(), logits)
            return m, nxt, logits, self.rollback(state, verified, m), features
        return self._verify_greedy((batch == 1, tokens), f"greedy verify step ({tokens} tokens, {_batch_label(batch)})",
                                   STEP_CALLS, *(_prepare(a, batch, {}) for a in (input_ids, positions, lengths, logit_index)),
                                   _prepare(state, batch, self.capacity_dims))

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
        feeds = _pad_rows({"input_ids": input_ids, "positions": positions}, input_ids.shape[0], tokens, pad)
        if rows == tokens:  # logits of every row (the usual verify): the padded rows' too, cut off below
            logit_index = torch.cat([logit_index, logit_index[:, -1:] + torch.arange(
                1, pad - tokens + 1, dtype=logit_index.dtype, device=logit_index.device)], 1)
        logits, new_state, features = self.forward(feeds["input_ids"], feeds["positions"], lengths, logit_index,
                                                   state, verify=True)
        features = {k: v[:, :tokens] if v.dim() > 1 and v.shape[1] == pad else v for k, v in features.items()}
        return logits[:, :rows], new_state, features

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


class CompiledDraft(EagerDraft):
    """``EagerDraft`` with the draft network's short chunks compiled; ``weight_dtype="bfloat16"``
    multiplies by its weights rounded to bf16 in those graphs (``torch_backend.product_form``):
    half the bytes a proposal streams, the same speculative output (the target verifies);
    ``matmul_precision="medium"`` rounds the activations too (``product_form``).

    Feature drafts (eagle, eagle3, mtp) pad a catch-up chunk of 2..K rows to K+1 rows (``pad_to``):
    padded rows lie past ``lengths`` and past every valid position, so they change no valid output
    and write only KV slots that later rows overwrite before anything reads them; so one graph serves
    every catch-up. One-row steps (proposals, a catch-up of one row) have their own graph; a short
    prompt's context runs through the K+1-row step chunk by chunk (``_prompt_chunks``). Block drafts
    (dflash, dspark) get one graph per step too: their proposer pads the context rows verified since
    the last step (1..K+1) to K+1 (``pad_to``), rows whose slots the block itself overwrites. P-EAGLE's
    chunk (the 1..K+1 rows verified since the last step, then K-1 placeholders) is right-padded to 2K
    rows, as a ragged batch pads a shorter sequence: one graph per K (compiling each width instead
    cost far more than it saved: 17 tokens/s against 480 target-only)."""

    def __init__(self, module, target_vocab: int, device="cpu", max_draft_len: int = 4,
                 weight_dtype: str = "auto", matmul_precision: str = "highest"):
        super().__init__(module, target_vocab, device)
        self.pad_to = max_draft_len + 1
        self.parallel_width = 2 * max_draft_len   # P-EAGLE: K+1 verified rows at most, K-1 placeholders
        # a chain's catch-up chunk (the rows the last verify accepted, 1..K+1) padded to the next of
        # these: a 5-row draft chunk computes 5 rows however few are real, and in an eagle3 run on the
        # embedded model 45% of steps accept 0 or 1 drafts (1 or 2 rows)
        self.catch_up_rows = sorted({r for r in (1, 2, 3) if r < self.pad_to} | {self.pad_to})
        self._feature = None       # (width, dtype) of the target features a chain was fed (``warm_chain``)
        self.capacity_dims = {"past." + k: v for k, v in _dims(module.state_spec).items()}
        steps = functools.partial(_Steps, options={**DRAFT_OPTIONS, **device_options(device)},
                                  product_form=product_form(weight_dtype, matmul_precision))
        self._steps = steps(self.components["draft"].call, f"{self.kind} draft")
        self._tree_steps = steps(self._tree_step, f"{self.kind} draft tree")
        self._chains = steps(self._chain if self.kind in FEATURE_DRAFTS else self._block_chain, f"{self.kind} draft chain")
        self._trees = steps(self._tree_chain if self.kind in FEATURE_DRAFTS else self._block_tree,
                            f"{self.kind} draft tree")

    def new_state(self, batch, capacity):
        return super().new_state(batch, capacity + HEADROOM)

    @torch.no_grad()
    def tree_step(self, ids, own_hidden, positions, slots, visible, state):
        batch, rows = ids.shape
        key = (batch == 1, rows)
        visible = _prepare(visible, batch, {})
        torch._dynamo.maybe_mark_dynamic(visible, 2)
        return self._tree_steps(key, f"{self.kind} draft tree step ({rows} rows, {_batch_label(batch)})", STEP_CALLS,
                                *(_prepare(t, batch, {}) for t in (ids, own_hidden, positions, slots)), visible,
                                _prepare(state, batch, self._state_dims()))

    @torch.no_grad()
    def chain(self, ids, features, positions, lengths, state, k: int):
        """The whole greedy proposal (``EagerDraft.chain``) as one graph per k and catch-up bucket:
        the catch-up chunk padded to the next of ``catch_up_rows``."""
        if features is not None:
            self._feature = (features.shape[-1], features.dtype)
        return self._catch_up_graph(self._chains, self._chain, k, f"chain ({k} tokens", self.catch_up_rows,
                                    ids, features, positions, lengths, state)

    def catch_up_width(self, rows: int, tree: bool = False) -> int:
        """The bucket a catch-up chunk of ``rows`` rows runs as (the proposer builds it that wide,
        rather than this draft padding it again): the next of ``catch_up_rows`` (a tree's: K+1)."""
        if self.kind not in FEATURE_DRAFTS or rows > self.pad_to:
            return rows
        return next(r for r in ((self.pad_to,) if tree else self.catch_up_rows) if r >= rows)

    @torch.no_grad()
    def tree_chain(self, ids, features, positions, lengths, state, shape):
        """The whole greedy tree (``EagerDraft.tree_chain``) as one graph per tree shape, the
        catch-up chunk padded to K+1 rows, as ``run`` pads it."""
        return self._catch_up_graph(self._trees, self._tree_chain, shape, f"tree ({shape.max_nodes} nodes",
                                    (self.pad_to,), ids, features, positions, lengths, state)

    def _catch_up_graph(self, steps, fn, last, label, buckets, ids, features, positions, lengths, state):
        """``fn(ids, features, positions, lengths, state, last)`` as one graph per ``last`` and
        bucket, its catch-up chunk padded to the next of ``buckets`` (a longer one runs eagerly)."""
        batch, rows = ids.shape
        if self.kind not in FEATURE_DRAFTS or rows > self.pad_to:
            return fn(ids, features, positions, lengths, state, last)
        pad = next(r for r in buckets if r >= rows)
        if rows < pad:
            feeds = _pad_rows({"ids": ids, "features": features, "positions": positions}, batch, rows, pad)
            ids, features, positions = feeds["ids"], feeds["features"], feeds["positions"]
        return steps((batch == 1, last, pad), f"{self.kind} draft {label}, {pad}-row catch-up, {_batch_label(batch)})",
                     STEP_CALLS, *(_prepare(t, batch, {}) for t in (ids, features, positions, lengths)),
                     _prepare(state, batch, self._state_dims()), last)

    def warm_chain(self, k: int, batch: int = 1) -> None:
        """Runs the chain of ``k`` proposals on a scratch state for every catch-up bucket until each
        graph is compiled (or loaded): which buckets a short warm-up run meets depends on what it
        accepted, and a bucket first met mid-run would stall it for a compile. Then the plain step's
        buckets (``run``: 1 row, and 2..K+1 padded to K+1), which a catch-up outside a chain takes (a
        step proposing one token, as a request's last steps do, or a sampled one)."""
        if self.kind not in FEATURE_DRAFTS or self._feature is None:
            return
        for rows in self.catch_up_rows:
            ids, features, positions, lengths = self._scratch_chunk(rows, batch)
            state = self.new_state(batch, 2 * MAX_TOKENS)
            for _ in range(STEP_CALLS):
                self.chain(ids, features, positions, lengths, state, k)
        for rows in sorted({1, self.pad_to}):
            ids, features, positions, lengths = self._scratch_chunk(rows, batch)
            state = self.new_state(batch, 2 * MAX_TOKENS)
            index = (lengths - 1).to(torch.int32)[:, None]
            for _ in range(STEP_CALLS):
                self.step(ids, features, None, positions, lengths, index, state)

    def _scratch_chunk(self, rows: int, batch: int):
        """Zero inputs of a ``rows``-row catch-up chunk fed target features (what warm-ups run)."""
        width, dtype = self._feature
        return (torch.zeros(batch, rows, dtype=torch.int32, device=self.device),
                torch.zeros(batch, rows, width, dtype=dtype, device=self.device),
                torch.arange(rows, dtype=torch.int32, device=self.device).expand(batch, -1),
                torch.full((batch,), rows, dtype=torch.int32, device=self.device))

    @torch.no_grad()
    def run(self, name: str, feeds: dict) -> dict:
        if name == "draft" and self.kind in BLOCK_DRAFTS:
            return self._run_block(feeds)
        if name == "draft" and self.kind in PARALLEL_DRAFTS:
            return self._run_parallel(feeds)
        if name != "draft" or self.kind not in FEATURE_DRAFTS:
            return super().run(name, feeds)
        batch, rows = feeds["input_ids"].shape
        if rows > self.pad_to:   # a prompt's context
            if rows <= PROMPT_COMPILED_MAX and batch == 1 and int(feeds["lengths"][0]) == rows \
                    and feeds["logit_index"].shape == (1, 1):
                return self._prompt_chunks(feeds)
            return self.components[name].call(feeds)
        pad = self.pad_to if 1 < rows < self.pad_to else rows
        if pad > rows:
            feeds = _pad_rows(feeds, batch, rows, pad)
        shapes = tuple((k, tuple(v.shape[1:])) for k, v in feeds.items()
                       if isinstance(v, torch.Tensor) and k not in self.capacity_dims)
        out = self._steps((batch == 1, shapes), f"{self.kind} draft step ({pad} rows, {_batch_label(batch)})",
                          STEP_CALLS, _prepare(feeds, batch, self.capacity_dims))
        if pad > rows and "hidden_out" in out:
            out = dict(out, hidden_out=out["hidden_out"][:, :rows])
        return out

    def _prompt_chunks(self, feeds: dict) -> dict:
        """A short prompt's context (one sequence) as compiled K+1-row steps, the KV state carried
        from chunk to chunk and the last chunk right-padded (``run``'s own padding): eagerly the
        draft's catch-up of a bench prompt cost 2.1-2.6 ms a request, a step's worth of several.
        Returns what one call would: ``hidden_out`` of every row, the logits at ``logit_index``
        and the state after the last row."""
        rows, width = feeds["input_ids"].shape[1], self.pad_to
        index = int(feeds["logit_index"][0, 0])
        per_row = {k: v for k, v in feeds.items() if isinstance(v, torch.Tensor) and v.dim() >= 2
                   and v.shape[1] == rows and k != "logit_index" and not k.startswith("past.")}
        state = {k: v for k, v in feeds.items() if k.startswith("past.")}
        hidden, logits = [], None
        for start in range(0, rows, width):
            real = min(width, rows - start)
            chunk = {**feeds, **{k: v[:, start:start + width] for k, v in per_row.items()}, **state,
                     "lengths": torch.full_like(feeds["lengths"], real),
                     "logit_index": torch.full_like(feeds["logit_index"], min(max(index - start, 0), real - 1))}
            out = self.run("draft", chunk)
            state = {"past." + k.removeprefix("present."): v for k, v in out.items() if k.startswith("present.")}
            hidden.append(out["hidden_out"][:, :real])
            if start <= index < start + width:
                logits = out["logits"]
        return dict(out, logits=logits, hidden_out=torch.cat(hidden, 1))

    @torch.no_grad()
    def block_chain(self, feeds: dict, state: dict, anchor):
        """A block draft's whole greedy proposal (``EagerDraft.block_chain``) as one graph once its
        shapes recur (the proposer pads the context rows to ``pad_to``); other steps eagerly."""
        return self._block_graph(self._chains, self._block_chain, "chain", feeds, state, anchor)

    @torch.no_grad()
    def block_tree(self, feeds: dict, state: dict, anchor, shape):
        """A block draft's whole greedy tree (``EagerDraft.block_tree``) as one graph per tree shape
        once its shapes recur; other steps eagerly."""
        return self._block_graph(self._trees, self._block_tree, f"tree ({shape.max_nodes} nodes)", feeds, state,
                                 anchor, shape)

    def _block_graph(self, steps, fn, label, feeds, state, anchor, *rest):
        if self.kind not in BLOCK_DRAFTS or feeds["aux"].shape[1] > MAX_TOKENS:
            return fn(feeds, state, anchor, *rest)
        batch = feeds["input_ids"].shape[0]
        if feeds["aux"].shape[1] != self.pad_to:   # a prompt's context
            return fn(feeds, state, anchor, *rest)
        shapes = tuple((k, tuple(v.shape[1:])) for k, v in feeds.items() if isinstance(v, torch.Tensor))
        return steps((batch == 1, shapes, *rest), f"{self.kind} draft {label} ({feeds['aux'].shape[1]} context rows, "
                     f"{_batch_label(batch)})", STEP_CALLS,
                     _prepare(feeds, batch, {}), _prepare(state, batch, self._state_dims()),
                     _prepare(anchor, batch, {}), *rest)

    def _state_dims(self) -> dict:
        return {n[len("past."):]: d for n, d in self.capacity_dims.items()}

    def _run_block(self, feeds: dict) -> dict:
        """A block draft's step: compiled once its shapes recur (the proposer pads the context rows
        to ``pad_to``, so a steady step has one shape); a prompt's context stays eager."""
        batch = feeds["input_ids"].shape[0]
        if feeds["aux"].shape[1] != self.pad_to:   # a prompt's context
            return self.components["draft"].call(feeds)
        shapes = tuple((k, tuple(v.shape[1:])) for k, v in feeds.items()
                       if isinstance(v, torch.Tensor) and k not in self.capacity_dims)
        return self._steps((batch == 1, shapes), f"{self.kind} draft step ({feeds['aux'].shape[1]} context rows, "
                           f"{_batch_label(batch)})", STEP_CALLS,
                           _prepare(feeds, batch, self.capacity_dims))

    def _run_parallel(self, feeds: dict) -> dict:
        """A P-EAGLE step right-padded to 2K rows (K+1 catch-up rows at most, K-1 placeholders): the
        padded rows lie past ``lengths`` at positions past the last placeholder, which no valid row
        sees and the next step's rows overwrite before any reads them. A prompt's rows stay eager."""
        batch, rows = feeds["input_ids"].shape
        width = self.parallel_width
        if rows > width or width > min(MAX_TOKENS, HEADROOM):
            return self.components["draft"].call(feeds)
        if rows < width:
            feeds = _pad_rows(feeds, batch, rows, width)
        shapes = tuple((k, tuple(v.shape[1:])) for k, v in feeds.items()
                       if isinstance(v, torch.Tensor) and k not in self.capacity_dims)
        return self._steps((batch == 1, shapes), f"{self.kind} draft step ({width} rows, {_batch_label(batch)})",
                           STEP_CALLS, _prepare(feeds, batch, self.capacity_dims))


def _pad_rows(feeds: dict, batch: int, rows: int, pad: int) -> dict:
    """Right-pads every [B, rows, ...] feed to ``pad`` rows: positions continue past the last row,
    everything else is zero; ``lengths`` and ``logit_index`` are unchanged."""
    out = {}
    for name, v in feeds.items():
        if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == batch and v.shape[1] == rows
                and name not in ("logit_index",) and not name.startswith("past.")):
            out[name] = v
        elif name == "positions":
            out[name] = torch.cat([v, v[:, -1:] + torch.arange(1, pad - rows + 1, dtype=v.dtype, device=v.device)], 1)
        else:
            out[name] = torch.cat([v, v.new_zeros((batch, pad - rows) + tuple(v.shape[2:]))], 1)
    return out


def warm_up(loaded, prompts, draft_len: int = 0, tree=None, **generate_args) -> float:
    """A short greedy run of ``prompts`` (speculative with ``draft_len`` > 0, with token trees of
    shape ``tree`` if given, then target-only on the first prompt, as the CLI's cost line runs it) so
    that the steps a timed run of them uses are compiled, or loaded from the cache, before it starts.
    Returns the seconds it took (0 when ``loaded`` is not on the compiled path)."""
    from runtime.generation import generate
    from runtime.speculative import speculative_generate
    if not isinstance(loaded.runner, CompiledRunner):
        return 0.0
    start = time.perf_counter()
    steps = STEP_CALLS + 2
    if draft_len > 0:
        proposer = loaded.proposer()
        speculative_generate(loaded.runner, proposer, prompts, steps * (draft_len + 1), draft_len, tree=tree,
                             **generate_args)
        if isinstance(getattr(proposer, "draft", None), CompiledDraft) and tree is None:
            proposer.draft.warm_chain(draft_len, len(prompts))
        policy = getattr(loaded, "draft_policy", None)
        if tree is None and policy is not None and policy.confidence_threshold:   # steps trimmed to fewer drafts
            for tokens in loaded.runner.verify_buckets:
                if tokens <= draft_len:
                    loaded.runner.warm_verify(tokens, len(prompts))
        draft = getattr(proposer, "runner", None)          # a draft_target draft: a NemotronH of its own
        if isinstance(draft, CompiledRunner):              # [last draft, bonus], queued after a full accept;
            for tokens in range(2, 2 + (tree.depth if tree is not None else 1)):   # after a tree: 1..depth+1 rows
                draft.warm(tokens, len(prompts))
    generate(loaded.runner, prompts[:1] if draft_len > 0 else prompts, steps, **generate_args)
    return time.perf_counter() - start


def warm_up_for_serving(loaded, draft_len: int, log=None) -> float:
    """What a server's requests run, compiled (or loaded from the cache) before it reports ready:
    greedy and sampled, one sequence and two (batch 1 and the batch-2+ graphs), speculative and
    target-only; then ``stop_compiling``. Returns the seconds it took (0 off the compiled path)."""
    if not isinstance(loaded.runner, CompiledRunner):
        return 0.0
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    seconds = 0.0
    for batch in (prompts[:1], prompts):
        for sampling in ({}, {"temperature": 0.8, "seed": 0}):
            seconds += warm_up(loaded, batch, draft_len, max_seq_len=loaded.max_seq_len, **sampling)
            if log is not None:
                log(f"warm-up: batch {len(batch)}, {'sampled' if sampling else 'greedy'}: {seconds:.1f} s so far")
    if draft_len > 0:   # target-only requests (speculative: false) batched with others
        seconds += warm_up(loaded, prompts, 0, max_seq_len=loaded.max_seq_len)
    stop_compiling()
    return seconds
