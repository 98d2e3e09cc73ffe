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

Quantized W2: when the weights carry an NVFP4 ``markov_head.markov_w2`` (packed ``weight`` uint8
[Vd, r/2] with ``weight_scale`` [Vd, r/16] FP8 and ``weight_scale_2``), ``markov_logits`` calls the
fused plugin op ``F.fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)``
(``plugins/fp4_markov_head.py``); otherwise plain ops (embedding gather + linear + add).
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
        self.markov_w2_fp4 = None  # (packed uint8, block scales, global scale) when W2 is NVFP4
        if self.markov_rank > 0:
            self.markov_w1 = weights[W1].to(dtype)
            scale = weights.get(W2 + "_scale")
            if scale is not None:
                self.markov_w2_fp4 = (weights[W2], scale, weights[W2 + "_scale_2"])
            else:
                self.markov_w2 = weights[W2].to(dtype)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    def markov_bias(self, prev_ids):
        """fp32 bias [..., Vd] = W2 @ W1[prev_ids] for previous TARGET token ids prev_ids [B, G]
        (plain ops; with an NVFP4 W2, eager only: the fused op applied to zero logits)."""
        if not self.has_markov:
            raise DraftError("dspark draft: markov_rank is 0, the checkpoint has no Markov head")
        if self.markov_w2 is None:
            zeros = torch.zeros(tuple(prev_ids.shape) + (self.vocab_size,), dtype=torch.float32)
            return self.markov_logits(zeros, prev_ids)
        return F.to_float32(F.linear(F.embedding(prev_ids, self.markov_w1), self.markov_w2))

    def markov_logits(self, logits, prev_ids):
        """logits [B, G, Vd] fp32 (block rows) + bias(prev_ids [B, G]): the distribution each
        draft token is chosen from. Uses the fused FP4 Markov head op when W2 is NVFP4."""
        if not self.has_markov:
            return logits
        if self.markov_w2_fp4 is not None:
            op = getattr(F, "fp4_markov_head", None)
            if op is None:
                raise DraftError("dspark draft: markov_head.markov_w2 is NVFP4 but builder.functional has no "
                                 "fp4_markov_head op (plugins/fp4_markov_head.py)")
            packed, scale, scale_2 = self.markov_w2_fp4
            return op(logits, prev_ids, self.markov_w1, packed, scale, scale_2)
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
