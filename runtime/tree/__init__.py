"""Tree speculation: each step verifies a token tree of drafted candidates in one target forward
instead of a chain. ``draft`` grows the tree from a draft (EAGLE-2's dynamic tree: ``TreeShape``,
``DraftTree``, the ``--tree`` options), ``paths`` holds what a verified tree means (ancestors, root
paths, greedy and rejection-sampling acceptance along them), and ``group`` runs the steps
(``TreeSpeculativeGroup``: grow, verify, accept, roll the target back to the accepted path). The
target's tree forward itself (tree attention mask, Mamba scan and conv along ancestor paths) is the
model's, lowered by ``builder.backends.torch_tree`` and ``trt_tree``.
"""
