"""The draft side of the compiled CPU path: a draft network's short chunks (proposal rows, catch-up
chunks, block and parallel drafts' steps, tree growth) compiled, the rest eager (``EagerDraft``)."""
from __future__ import annotations

import functools

import torch

from runtime.compiled.shapes import (BLOCK_DRAFTS, DRAFT_OPTIONS, FEATURE_DRAFTS, HEADROOM, MAX_TOKENS,
                                     PARALLEL_DRAFTS, PROMPT_COMPILED_MAX, STEP_CALLS, _batch_label,
                                     _dims, _pad_rows, _prepare)
from runtime.compiled.steps import _Steps, device_options, product_form
from runtime.drafts import EagerDraft


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
        # a chain's catch-up chunk (the rows the last verify accepted, 1..K+1) padded to 2 or K+1 rows:
        # in an eagle3 run on the embedded model 45% of steps accept 0 or 1 drafts (1 or 2 rows), and
        # 36% all K (K+1 rows). Two graphs per chain, not four (1, 2, 3, K+1): each is a compile of
        # 13-16 s (wide model, Zen 4) in every warm-up, and a padded row of a ~1 M-parameter draft
        # costs ~0.02 ms against a 5.5 ms step
        self.catch_up_rows = sorted({min(2, self.pad_to), self.pad_to})
        self._feature = None       # (width, dtype) of the target features a step was fed (``warm_chain``)
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

    def _saw(self, features) -> None:
        """Remembers the target features' width and dtype: the warm-ups' scratch chunks are fed the same."""
        if features is not None:
            self._feature = (features.shape[-1], features.dtype)

    def step(self, ids, target_features, own_hidden, positions, lengths, logit_index, state):
        """``EagerDraft.step``; a K = 1 run proposes from these steps alone (no chain), so they too
        tell ``warm_chain`` the features' width."""
        self._saw(target_features)
        return super().step(ids, target_features, own_hidden, positions, lengths, logit_index, state)

    @torch.no_grad()
    def chain(self, ids, features, positions, lengths, state, k: int):
        """The whole greedy proposal (``EagerDraft.chain``) as one graph per k and catch-up bucket:
        the catch-up chunk padded to the next of ``catch_up_rows``."""
        self._saw(features)
        run = self._warmed_chain_length(k, ids, positions, lengths, state)
        tokens, conf, *rest = self._catch_up_graph(self._chains, self._chain, run, f"chain ({run} tokens",
                                                   self.catch_up_rows, ids, features, positions, lengths, state)
        return (tokens[:, :k], conf[:, :k], *rest)

    def _warmed_chain_length(self, k: int, ids, positions, lengths, state) -> int:
        """The chain length to run for a proposal of ``k``: ``k``, or after a server's warm-up, when
        no graph of ``k`` was warmed (a request's own num_draft_tokens below the engine's K), the
        shortest longer chain that was, where the draft's cache has room for its rows. A greedy
        chain's first k tokens are the chain of k (the same argmaxes in the same order), and the rows
        past them lie past every position the next catch-up reads, so it overwrites them first."""
        batch, rows = ids.shape
        if (self.kind not in FEATURE_DRAFTS or rows > self.catch_up_rows[-1]
                or not all(self._state_dims().values())):   # a state without slots (a recurrent one)
            return k
        pad = self.catch_up_width(rows)
        longer = sorted(key[1] for key in self._chains.ready if key[0] == (batch == 1) and key[2] == pad and key[1] > k)
        run = self._chains.first_compiled([k, *longer], lambda n: (batch == 1, n, pad))
        if run == k:
            return k
        room = min((state[n].shape[d] for n, dims in self._state_dims().items() if n in state for d in dims),
                   default=0)
        return run if int((positions[:, 0] + lengths).max()) + run - 1 <= room else k

    def catch_up_width(self, rows: int, tree_depth: int = 0) -> int:
        """The bucket a catch-up chunk of ``rows`` rows runs as (the proposer builds it that wide,
        rather than this draft padding it again): the next of ``catch_up_rows``, or after a tree of
        ``tree_depth``, its one width (``_tree_width``); a longer chunk runs eagerly as it is."""
        buckets = (self._tree_width(tree_depth),) if tree_depth else self.catch_up_rows
        if self.kind not in FEATURE_DRAFTS or rows > buckets[-1]:
            return rows
        return next(r for r in buckets if r >= rows)

    def _tree_width(self, depth: int) -> int:
        """A tree chain's catch-up width: K+1, or a deeper tree's longest accepted path (depth + 1
        rows: a tree deeper than K ran its long catch-ups eagerly), within the slots past capacity."""
        return min(max(self.pad_to, depth + 1), HEADROOM)

    @torch.no_grad()
    def tree_chain(self, ids, features, positions, lengths, state, shape):
        """The whole greedy tree (``EagerDraft.tree_chain``) as one graph per tree shape, the
        catch-up chunk padded to ``_tree_width`` rows, as ``catch_up_width`` pads it."""
        self._saw(features)
        return self._catch_up_graph(self._trees, self._tree_chain, shape, f"tree ({shape.max_nodes} nodes",
                                    (self._tree_width(shape.depth),), ids, features, positions, lengths, state)

    def _catch_up_graph(self, steps, fn, last, label, buckets, ids, features, positions, lengths, state):
        """``fn(ids, features, positions, lengths, state, last)`` as one graph per ``last`` and
        bucket, its catch-up chunk padded to the next of ``buckets`` (a longer one runs eagerly)."""
        batch, rows = ids.shape
        if self.kind not in FEATURE_DRAFTS or rows > buckets[-1]:
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
        accepted, and a bucket first met mid-run would stall it for a compile. Then ``warm_steps``
        (all of it at k = 1, which proposes without a chain: ``_fused``)."""
        if self.kind not in FEATURE_DRAFTS or self._feature is None:
            return
        for rows in self.catch_up_rows if k > 1 else ():
            ids, features, positions, lengths = self._scratch_chunk(rows, batch)
            state = self.new_state(batch, 2 * MAX_TOKENS)
            for _ in range(STEP_CALLS):
                self.chain(ids, features, positions, lengths, state, k)
        self.warm_steps(batch)

    def warm_steps(self, batch: int = 1) -> None:
        """The plain step's buckets (``run``: 1 row, and 2..K+1 padded to K+1) until compiled: a
        catch-up outside a chain or tree takes them (a step proposing one token, as a request's last
        steps do, or a sampled one), and so does a prompt's context (``_prompt_chunks``), which a run
        meets once: the timed run after a one-run warm-up would compile them (6-7 s here)."""
        if self.kind not in FEATURE_DRAFTS or self._feature is None:
            return
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
        drafts = feeds["logit_index"].shape[1]   # K: one graph per K (its logit rows), all of one width
        return self._steps((batch == 1, shapes), f"{self.kind} draft step ({width} rows, K={drafts}, {_batch_label(batch)})",
                           STEP_CALLS, _prepare(feeds, batch, self.capacity_dims))
