"""DSpark draft: the DFlash backbone plus a Markov head, as speculators 0.9.0 (``DSparkDraftModel``,
``MarkovHead``) and the serving engines (vLLM ``v1/spec_decode/dspark.py``, SGLang
``models/dspark.py`` ``VanillaMarkov``) define it.

The backbone is :class:`builder.models.dflash.DFlashDraft` unchanged (same inputs, state and
block forward). The vanilla Markov head adds a low-rank sequential logit bias::

    bias(prev) = W2 @ W1[prev]        W1 = markov_head.markov_w1.weight [V_target, r] (indexed by
                                      TARGET token ids), W2 = markov_head.markov_w2.weight [V_draft, r]

while the block's tokens are chosen left to right: draft token j (1-based) is chosen from

    logits_j = backbone logits of its block row + bias(token_{j-1})

where token_0 is the anchor (the last accepted token) and token_{j-1} the draft token just chosen
(mapped to its target id through ``d2t`` when the draft vocabulary is reduced). With
``sample_from_anchor`` (read from the top-level config field, absent -> true, speculators'
DSpark default) the block is the anchor + K-1 mask rows and row j-1 gives draft j; without it the
block is the anchor + K mask rows, the anchor row is dropped and row j gives draft j. Either way
"row of draft j + bias(previous token)": speculators trains slot k with ``prev_token_ids =
block_tokens[k]`` (sample_from_anchor) or ``block_tokens[k-1]`` (not), which is the same pairing.

The loop therefore: runs the block (``forward`` / ``block``, ``logit_index = [first_draft_row ..]``)
-> base logits [B, K, Vd]; then for j = 1..K: ``logits_j = markov_logits(base[:, j-1], prev)``,
choose d_j (argmax, or sample and keep the distribution for rejection sampling), ``prev = d_j``
(as a target id). Only the vanilla head is implemented; ``gated`` / ``rnn`` are refused when the
checkpoint is read (``markov_head_type``).

Quantized W2: when ``markov_head.markov_w2.weight`` is a :class:`builder.nvfp4_format.NVFP4Weight`
(``load_block_draft_checkpoint`` of a ModelOpt NVFP4 checkpoint keeps it packed: uint8 [Vd, r/2],
FP8 block scales [Vd, r/16], FP32 global scale), ``markov_logits`` calls the fused plugin op
``F.fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)``
(``plugins/fp4_markov_head.py``); otherwise plain ops (embedding gather + linear + add). Other NVFP4
linear weights of the backbone go through ``F.linear``'s NVFP4 path unchanged.
"""
from __future__ import annotations

import torch

from builder import functional as F
from builder.errors import DraftError
from builder.models.dflash import DFlashDraft

W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"


class DSparkDraft(DFlashDraft):
    kind = "dspark"

    def __init__(self, cfg, weights: dict, target_embedding=None, target_lm_head=None, dtype=torch.float32):
        super().__init__(cfg, weights, target_embedding, target_lm_head, dtype)
        self.markov_rank = int(getattr(cfg, "markov_rank", 0))
        self.markov_w1 = self.markov_w2 = None
        if self.markov_rank > 0:
            self.markov_w1 = weights[W1].to(dtype)
            self.markov_w2 = weights[W2].to(dtype)  # a tensor, or a builder.nvfp4_format.NVFP4Weight

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def markov_w2_fp4(self) -> bool:
        """Whether W2 is NVFP4 (then ``markov_logits`` uses the fused ``fp4_markov_head`` op)."""
        return bool(getattr(self.markov_w2, "is_nvfp4", False))

    def markov_bias(self, prev_ids):
        """fp32 bias [B, G, Vd] = W2 @ W1[prev_ids] for previous TARGET token ids prev_ids [B, G]
        (plain ops: embedding gather + linear; an NVFP4 W2 goes through ``F.linear``'s NVFP4 path)."""
        if not self.has_markov:
            raise DraftError("dspark draft: markov_rank is 0, the checkpoint has no Markov head")
        return F.to_float32(F.linear(F.embedding(prev_ids, self.markov_w1), self.markov_w2))

    def markov_logits(self, logits, prev_ids):
        """logits [B, G, Vd] fp32 (block rows) + bias(prev_ids [B, G]): the distribution each
        draft token is chosen from. The hook for a quantized W2: when W2 is NVFP4 this is the fused
        ``F.fp4_markov_head(logits, prev_ids, W1, W2 packed, W2 scale, W2 scale_2)`` (one plugin
        layer in TensorRT); otherwise gather + linear + add."""
        if not self.has_markov:
            return logits
        if self.markov_w2_fp4:
            op = getattr(F, "fp4_markov_head", None)
            if op is None:
                raise DraftError("dspark draft: markov_head.markov_w2 is NVFP4 but builder.functional has no "
                                 "fp4_markov_head op (plugins/fp4_markov_head.py)")
            w2 = self.markov_w2
            return op(logits, prev_ids, self.markov_w1, w2.packed, w2.scale, w2.scale_2)
        return logits + self.markov_bias(prev_ids)

    def choose_block(self, base_logits, anchor_ids, choose):
        """Reference left-to-right selection (torch): base_logits [B, K, Vd] (the K draft rows),
        anchor_ids [B] target ids, ``choose(logits [B, Vd]) -> draft ids [B]``. Returns (draft ids
        [B, K], the logits each was chosen from [B, K, Vd])."""
        prev = torch.as_tensor(anchor_ids).reshape(-1, 1).long()
        tokens, used = [], []
        for j in range(base_logits.shape[1]):
            row = self.markov_logits(base_logits[:, j:j + 1], prev)
            token = choose(row[:, 0]).long()
            tokens.append(token)
            used.append(row[:, 0])
            prev = (token if self.d2t is None else token + self.d2t.to(token.device)[token])[:, None]
        return torch.stack(tokens, 1), torch.stack(used, 1)
