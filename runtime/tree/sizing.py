"""``--max_tree_nodes auto``: the tree size, or the plain chain, that makes speculation fastest here.

A tree's extra tokens come from the draft's second and later choices, which a chain run never shows,
and its verify rows cost what this machine's products cost at that row count; both are measured
rather than modelled. On one calibration prompt each candidate runs once (the chain of K, then
trees of 4, 8, 16, ... nodes up to the cap) beside one target-only run; each candidate's measured
step costs and tokens per step give the speedup the cost model predicts
(``step_costs.cost_model``: tokens per step x target-only step / speculative step), and the best
wins, ties to the chain and then to the smaller tree (fewer verify rows). On the compiled path each
tree size's steps are compiled (or loaded from the cache) before its run, so no compile is timed.
"""
from __future__ import annotations

from dataclasses import replace

from runtime.tree.draft import TreeShape

SIZES = (4, 8, 16, 32, 64)


def candidate_sizes(cap: int, least: int) -> list[int]:
    """Tree sizes to try: the standard sizes up to ``cap``, and ``cap`` itself; at least ``least``
    nodes (the top-k or depth: a smaller tree drops most of the root's children or the deep nodes)."""
    return sorted({n for n in SIZES if least <= n <= cap} | {cap})


def calibrate_tree(loaded, prompt: list[int], k: int, shape: TreeShape, cap: int, new_tokens: int = 48,
                   warm=None, **generate_args) -> dict:
    """The chain of ``k`` and trees of ``shape`` at each candidate size, each run once on ``prompt``
    beside a target-only run; ``warm(shape or None)`` readies a candidate's steps before it runs.
    Returns {"max_tree_nodes": the size chosen (None: the chain), "predicted": {candidate: speedup},
    "tokens_per_step": {candidate: tokens}} (candidates "chain", "4", "8", ...)."""
    from runtime.generation import generate
    from runtime.speculative import speculative_generate
    from runtime.step_costs import cost_model
    plain = generate(loaded.runner, [prompt], new_tokens, **generate_args).extra["cost"].summary()
    predicted, tokens = {}, {}
    for size in [None, *candidate_sizes(cap, max(shape.topk, shape.depth))]:
        tree = None if size is None else replace(shape, max_nodes=size)
        if warm is not None:
            warm(tree)
        run = speculative_generate(loaded.runner, loaded.proposer(), [prompt], new_tokens, k, tree=tree,
                                   **generate_args)
        model = cost_model(run.extra["cost"].summary(), plain)
        name = "chain" if size is None else str(size)
        predicted[name] = model["model_speedup"] or 0.0
        tokens[name] = model["speculative"]["tokens_per_step"]
    best = max(predicted, key=lambda c: (predicted[c], c == "chain", -int(c) if c != "chain" else 0))
    return {"max_tree_nodes": None if best == "chain" else int(best), "predicted": predicted, "tokens_per_step": tokens}


def describe(choice: dict) -> str:
    """One line for a log: the size chosen and every candidate's predicted speedup."""
    table = ", ".join(f"{c} {v:.2f}x" for c, v in choice["predicted"].items())
    kept = "the chain (no tree)" if choice["max_tree_nodes"] is None else f"{choice['max_tree_nodes']} nodes"
    return f"--max_tree_nodes auto: {kept} (predicted {table})"
