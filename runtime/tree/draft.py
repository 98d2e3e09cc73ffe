"""Growing a token tree from a draft (EAGLE-2's dynamic tree), for one verify of many candidates.

Depth by depth: the ``topk`` most probable nodes of the last depth (the frontier; the root at
first) each get ``topk`` children, the top-k tokens of the draft's distribution at that node; every
child is scored by its cumulative draft log-probability along its root path. A draft kind supplies
the frontier's distributions (``expand``): a chain draft runs one forward over the frontier rows,
a block draft reads its block row at that depth (with DSpark's Markov bias from each node's token).
The tree keeps the ``max_nodes`` best-scored candidates (a child never outranks its parent, so the
kept set is closed under ancestors) and lists them parents first.

Sampled sequences draw a node's children without replacement from the draft's sampling
distribution q (Gumbel top-k, in draw order) and keep candidates in creation order (depth, frontier
rank, draw order) rather than by their own scores: which children a node has then never depends on
their own values, which is what lets :func:`runtime.tree.paths.rejection_accept` keep the target's
distribution exactly. Every sequence of a batch grows the same number of candidates, so a batch's
trees have one size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling import SamplingParams, ban, probabilities


@dataclass(frozen=True)
class TreeShape:
    """The build, generate and bench options of tree speculation (``--max_tree_nodes``, ``--tree_topk``, depth)."""
    max_nodes: int = 16      # drafted nodes per verify, the root excluded
    topk: int = 4            # children per expanded node and nodes expanded per depth
    depth: int = 4           # the deepest node (draft forwards per step: depth - 1 for chain drafts)

    def __post_init__(self):
        if self.max_nodes < 1:
            raise ValueError(f"--max_tree_nodes: expected >= 1, got {self.max_nodes}")
        if self.topk < 1:
            raise ValueError(f"--tree_topk: expected >= 1, got {self.topk}")
        if self.depth < 1:
            raise ValueError(f"tree depth: expected >= 1, got {self.depth}")
        # a frontier wider, or a path deeper, than the tree's nodes could never be filled: only draft work
        if self.topk > self.max_nodes:
            raise ValueError(f"--tree_topk: expected at most --max_tree_nodes ({self.max_nodes}), got {self.topk}")
        if self.depth > self.max_nodes:
            raise ValueError(f"--tree_depth: expected at most --max_tree_nodes ({self.max_nodes}), got {self.depth}")

    @property
    def draft_rows(self) -> int:
        """Draft KV slots a chain draft's tree steps write past its position (frontiers of depth 1..depth-1)."""
        return (self.depth - 1) * self.topk


@dataclass
class DraftTree:
    """tokens / parents [B, T] (row 0 the root: the last accepted token, parent -1; parents[r] < r),
    depth [B, T], and for sampled sequences ``q`` [B, T, V]: the distribution row r's children were
    drawn from (zero for other rows; None when no sequence samples)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    q: torch.Tensor | None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def _top(logits, k: int):
    """logits [B, F, V] -> the top-k tokens [B, F, k] of the softmax and their log-probabilities."""
    top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return top.indices, top.values


def _children(logits, params: list[SamplingParams], k: int):
    """logits [B, F, V] -> (tokens [B, F, k], log q [B, F, k], q [B, F, V] or None). Greedy rows: the
    top-k of the softmax; sampled rows: k draws without replacement from the sampling distribution."""
    logits = ban(logits, params)
    tokens, scores = (t.cpu() for t in _top(logits, k))
    q = None
    for row, p in enumerate(params):
        if not p.temperature:
            continue
        if q is None:
            q = torch.zeros(logits.shape)
        q[row] = probabilities(logits[row], p.temperature, p.top_p, p.top_k).cpu()
        gumbel = -torch.log(-torch.log(torch.rand(q[row].shape, generator=p.generator).clamp_min(1e-20)))
        keys = torch.log(q[row]) + gumbel                       # top-k of log q + Gumbel: draws without replacement
        draws = keys.topk(k, dim=-1).indices
        tokens[row], scores[row] = draws, torch.log(q[row].gather(-1, draws))
    return tokens, scores, q


def grow(root_logits: torch.Tensor, expand, shape: TreeShape, params: list[SamplingParams],
         frontier: int | None = None) -> DraftTree:
    """root_logits [B, V] (the draft's distribution after the root); ``expand(tokens [B, F],
    parent [B, F] (each node's parent's index in the previous frontier), depth)`` returns the
    draft's logits [B, F, V] at those nodes. ``frontier``: nodes expanded per depth (default
    ``shape.topk``; a block draft, whose expansion costs no forward, expands ``max_nodes``: then the
    kept set is exactly the ``max_nodes`` most probable paths over the top-k tokens per depth).
    Returns the tree over target ids."""
    k = min(shape.topk, root_logits.shape[-1])
    sampled = torch.tensor([bool(p.temperature) for p in params])
    tree = _grow(root_logits, expand, shape, lambda logits: _children(logits, params, k), frontier,
                 sampled if bool(sampled.any()) else None)
    assert bool((tree.parents[:, 1:] >= 0).all()), "tree selection dropped a kept node's parent"
    return tree


def grow_greedy(root_logits: torch.Tensor, expand, shape: TreeShape, frontier: int | None = None) -> DraftTree:
    """:func:`grow` for greedy rows with nothing banned, in tensor ops only (no host sync, shapes
    fixed by ``shape``): the form a draft runs inside one compiled graph with its expansions."""
    k = min(shape.topk, root_logits.shape[-1])
    return _grow(root_logits, expand, shape, lambda logits: (*_top(logits, k), None), frontier, None)


def feature_expand(tree_step, hidden: torch.Tensor, position: torch.Tensor, state: dict, shape: TreeShape):
    """The ``expand`` of a chain draft (eagle, eagle3, mtp): one ``tree_step`` over the frontier
    rows, each fed its parent's hidden_out and seeing the committed slots (before ``position`` [B, 1])
    plus its ancestors'. The frontier of depth d writes slots position + (d-1)*topk + f; the next
    catch-up overwrites them. Returns (expand, the dict whose "state" is the state after the last call)."""
    dev = hidden.device
    position = position.to(dev).long()
    slots_all = torch.arange(next(iter(state.values())).shape[1], device=dev)
    front = {"hidden": hidden[:, None], "visible": (slots_all[None] < position)[:, None], "state": state}

    def expand(tokens, parent, depth):
        rows = tokens.shape[1]
        parent = parent.to(dev)
        slots = position + (depth - 1) * shape.topk + torch.arange(rows, device=dev)           # [B, F]
        visible = front["visible"].gather(1, parent[..., None].expand(-1, -1, slots_all.shape[0])).clone()
        visible.scatter_(2, slots[..., None], True)
        parent_hidden = front["hidden"].gather(1, parent[..., None].expand(-1, -1, hidden.shape[-1]))
        logits, out, front["state"] = tree_step(tokens.to(device=dev, dtype=torch.int32), parent_hidden,
                                                (position + depth - 1).expand(-1, rows).to(torch.int32),
                                                slots.to(torch.int32), visible, front["state"])
        front["hidden"], front["visible"] = out, visible
        return logits
    return expand, front


def model_expand(tree_forward, root: torch.Tensor):
    """The root logits and ``expand`` of a draft_target draft (a NemotronH of its own): its Mamba
    layers keep one state per sequence, so every call runs one tree forward from the state before
    the root (``tree_forward(tokens [B, T], parents [B, T])`` -> logits [B, T, V], state unchanged)
    over the root (row 0) and every node expanded so far; the new frontier's rows give the logits.
    Each row's Mamba state is its ancestor path's, as in the target's tree verify."""
    batch, dev = root.shape[0], root.device
    tree = {"tokens": root.to(torch.int32)[:, None], "parents": torch.full((batch, 1), -1, dtype=torch.long, device=dev),
            "front": torch.zeros(batch, 1, dtype=torch.long, device=dev)}

    def expand(tokens, parent, depth):
        first = tree["tokens"].shape[1]
        tree["tokens"] = torch.cat([tree["tokens"], tokens.to(device=dev, dtype=torch.int32)], 1)
        tree["parents"] = torch.cat([tree["parents"], tree["front"].gather(1, parent.to(dev).long())], 1)
        tree["front"] = first + torch.arange(tokens.shape[1], device=dev).expand(batch, -1)
        return tree_forward(tree["tokens"], tree["parents"])[:, first:]
    return tree_forward(tree["tokens"], tree["parents"])[:, 0], expand


def _grow(root_logits, expand, shape: TreeShape, children, frontier, sampled) -> DraftTree:
    """The growth loop of :func:`grow`; ``children(logits)`` -> (tokens, log q, q); ``sampled`` [B]
    bool, or None when every row is greedy."""
    batch, dev = root_logits.shape[0], root_logits.device
    k = min(shape.topk, root_logits.shape[-1])
    all_sampled = sampled is not None and bool(sampled.all())
    # per depth: candidates' tokens, parents, scores [B, F*k] and count; the expanded nodes [B, F], their q
    tokens, parents, scores, depths, heads, qs = [], [], [], [], [], []
    front_index = torch.full((batch, 1), -1, device=dev)        # frontier nodes' candidate indices (-1: root)
    front_score = torch.zeros(batch, 1, device=dev)
    logits, made = root_logits[:, None], 0
    for d in range(1, shape.depth + 1):
        child, logq, q = children(logits)                        # [B, F, k]
        front_index, front_score = front_index.to(child.device), front_score.to(child.device)
        width = child.shape[1]
        tokens.append(child.reshape(batch, -1))
        parents.append(front_index.repeat_interleave(k, 1))
        cand = (front_score[..., None] + logq).reshape(batch, -1)
        scores.append(cand)
        depths.append(width * k)
        heads.append(front_index)
        qs.append(q)
        first, made = made, made + width * k
        if d == shape.depth or (all_sampled and made >= shape.max_nodes):
            break                                                # (sampled trees keep creation order)
        best = cand.topk(min(frontier or shape.topk, cand.shape[1]), dim=1).indices
        front_index, front_score = first + best, cand.gather(1, best)
        logits = expand(tokens[-1].gather(1, best), best // k, d)
    return _select(tokens, parents, scores, depths, heads, qs, shape.max_nodes, sampled)


def _select(tokens, parents, scores, depths, heads, qs, max_nodes, sampled) -> DraftTree:
    """The kept candidates, as tree rows (root first, then creation order: parents before children)."""
    tokens, parents, scores = torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)
    dev = tokens.device
    depth_of = torch.cat([torch.full((n,), d + 1, device=dev) for d, n in enumerate(depths)])
    batch, n = tokens.shape
    keep = min(max_nodes, n)
    ranked = torch.sort(-scores, dim=1, stable=True).indices     # ties: the earlier candidate (a parent) first
    if sampled is not None:
        ranked = torch.where(sampled[:, None], torch.arange(n).expand(batch, -1), ranked)
    chosen = ranked[:, :keep].sort(dim=1).values
    row_of = torch.full((batch, n + 1), -1, dtype=torch.long, device=dev)   # candidate index (+1; 0 = root) -> tree row
    row_of[:, 0] = 0
    row_of.scatter_(1, chosen + 1, torch.arange(1, keep + 1, device=dev).expand(batch, -1))
    rows_parents = row_of.gather(1, parents.gather(1, chosen) + 1)
    zero = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    q = None
    if any(x is not None for x in qs):
        # each expanded node's q row (the root, then each depth's frontier), placed at its tree row
        vocab = next(x for x in qs if x is not None).shape[-1]
        q = torch.zeros(batch, keep + 1, vocab)
        for head, x in zip(heads, qs):
            if x is None:
                continue
            where = row_of.gather(1, head + 1)                  # [B, F]: tree row (-1: not kept)
            kept = where >= 0
            rows = torch.arange(batch)[:, None].expand_as(where)
            q[rows[kept], where[kept]] = x[kept]
    return DraftTree(torch.cat([zero, tokens.gather(1, chosen)], 1), torch.cat([zero - 1, rows_parents], 1),
                     torch.cat([zero, depth_of[chosen]], 1), q)


# --- flags: recorded at build (BuildOptions), overridable by generate and bench (serve runs chains) --
TREE_FLAGS = {  # flag -> (type, build default, help)
    "max_tree_nodes": (int, 16, "tree speculation: drafted nodes verified per step (the root excluded)"),
    "tree_topk": (int, 0, "tree speculation: children per expanded node, and nodes expanded per depth "
                          "(0 = by draft kind: 8 for dflash, dspark and peagle, 4 for eagle, eagle3 and mtp)"),
    "tree_depth": (int, 0, "tree speculation: the deepest node (0 = max_draft_len)"),
}


AUTO_NODES_CAP = 32    # the largest tree --max_tree_nodes auto tries where the engine directory records none

# Children per node by draft kind (--tree_topk 0). A block draft scores every depth in its one forward
# whatever k is, so a wider top-k costs it nothing but verify rows, which --max_tree_nodes fixes; at 16
# nodes (embedded model, 6 prompts x 128, greedy) top-8 accepted dflash +0.65 over its chain against
# +0.58 at top-4 (dspark +0.82 / +0.81, peagle +0.73 / +0.58). A chain draft runs each expanded node
# as a draft row, so k multiplies its draft work per depth: it keeps 4 (eagle3 +0.71; top-8 +0.78).
BLOCK_TREE_TOPK, CHAIN_TREE_TOPK = 8, 4
BLOCK_TREE_MODES = ("dflash", "dspark", "peagle")


def default_topk(mode: str | None) -> int:
    """``--tree_topk 0``'s value for a draft kind."""
    return BLOCK_TREE_TOPK if (mode or "").removesuffix("_nvfp4") in BLOCK_TREE_MODES else CHAIN_TREE_TOPK


def add_tree_args(parser, build: bool) -> None:
    """At build the tree flags set the engine directory's defaults and maximum node count; at
    generate and bench ``--tree`` turns tree speculation on (off by default) and the flags override
    the recorded values; the server verifies chains only."""
    group = parser.add_argument_group("tree speculation")
    if build:
        group.add_argument("--tree_engines", action="store_true",
                           help="also build tree_verify.engine (and a chain draft's draft_tree.engine), sized by "
                                "--max_tree_nodes, so that --tree runs on the TensorRT backend; each engine holds "
                                "its own weights unless --strip_plan")
    else:
        group.add_argument("--tree", action="store_true",
                           help="verify a token tree per step instead of a chain (every draft kind; torch and "
                                "compiled backends, and engine backends of a directory built with --tree_engines)")
    for flag, (kind, default, text) in TREE_FLAGS.items():
        sized = flag == "max_tree_nodes" and not build     # generate: `auto` sizes the tree here
        group.add_argument(f"--{flag}", type=_nodes_arg if sized else kind, default=default if build else None,
                           help=text + ("" if build else " (default: the engine directory's)") + (
                               "; auto (generate): the size, or the chain, whose measured costs and acceptance "
                               "predict the most tokens/s here (a calibration run of each on the first prompt)"
                               if sized else ""))


def _nodes_arg(text: str):
    """argparse type of --max_tree_nodes at generate: a positive int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer or 'auto', got {text!r}") from None


def tree_from(max_draft_len: int, recorded: dict, overrides=None, mode: str | None = None) -> TreeShape:
    """The tree shape of an engine directory (``recorded``: its build options) with flags on top; a
    node count above the recorded one is refused (the build sized its buffers for it); a top-k of 0
    is ``mode``'s default (``default_topk``)."""
    values = {f: recorded.get(f, default) for f, (_, default, _) in TREE_FLAGS.items()}
    built = int(values["max_tree_nodes"])
    for f in TREE_FLAGS:
        given = getattr(overrides, f, None) if overrides is not None else None
        if given is not None:
            values[f] = given
    if values["max_tree_nodes"] == "auto":   # the largest size auto may pick (runtime.tree.sizing)
        values["max_tree_nodes"] = built if "max_tree_nodes" in recorded else AUTO_NODES_CAP
    if "max_tree_nodes" in recorded and int(values["max_tree_nodes"]) > built:
        raise ValueError(f"--max_tree_nodes: expected at most {built} (the engine directory's), "
                         f"got {values['max_tree_nodes']}")
    nodes = int(values["max_tree_nodes"])
    depth = int(values["tree_depth"]) or min(max_draft_len, nodes)
    return TreeShape(nodes, int(values["tree_topk"]) or min(default_topk(mode), nodes), depth)
