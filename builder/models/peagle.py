"""P-EAGLE (parallel EAGLE) draft, as speculators 0.9.0 (``PEagleDraftModel``) and vLLM
(``PEagleSpeculator`` / the EAGLE proposer's parallel drafting) define it.

The network is EAGLE-3's (:mod:`builder.models.eagle3`: ``fc`` over the target's aux hidden
states, layer 0 on concat(embed-norm, hidden-norm), further decoder layers, norm, LM head,
``d2t``), with one difference: it proposes all K tokens in ONE forward. After the catch-up rows it
appends K-1 placeholder ("parallel drafting") rows whose token is ``mask_token_id`` and whose
target feature is the learned ``mask_hidden`` [k*Ht] (which goes through ``input_norm`` /
``fc_norm`` and ``fc`` like a real feature: speculators builds ``sampled_hidden = where(depth==0,
hidden_states, mask_hidden)`` before the norms and fc; vLLM caches
``combine_hidden_states(mask_hidden)``). No draft hidden is ever recycled.

Rows and positions (vLLM's row convention, as EAGLE-3 here: a row pairs the token at p+1 with the
target feature of p and uses position p; speculators' P-EAGLE uses the same position p: its
``position_ids`` are the shifted sequence indices)::

    catch-up row p  (p = s .. n-1):  input_ids = x_{p+1}, aux = g_p, is_mask = 0, position p
    placeholder d   (d = 1 .. K-1):  is_mask = 1 (token and aux are replaced), position n-1+d

Attention is causal over positions (the KV cache): placeholder d sees every catch-up row up to
n-1 and placeholders 1..d, which is speculators' P-EAGLE mask (``kv_depth0 & is_anchor_causal``
or ``same_rollout & q_depth >= kv_depth``). Logits of row n-1 give d_1, of placeholder d give
d_{d+1}: ``logit_index = [n-1, n, .., n+K-2]`` (in chunk rows). The K draft tokens are
independent given the context (each from its own row's distribution).

Module contract
---------------
``PEagleDraft(cfg, weights, target_embedding, dtype)`` with ``kind = "peagle"``,
``aux_layer_ids`` (= ``target_layer_ids``, HF hidden_states ids, ascending), ``aux_width``,
``hidden_size``, ``vocab_size`` (draft), ``target_vocab_size``, ``d2t``, ``mask_token_id``,
``num_speculative_tokens`` (the checkpoint's default K).

* ``state_spec(batch, capacity)``: KV cache per layer, as EAGLE-3.
* ``forward(input_ids, aux, is_mask, positions, lengths, logit_index, state) -> (logits [B, G, Vd]
  fp32, new_state)``; ``input_ids`` [B, T] int32, ``aux`` [B, T, k*Ht], ``is_mask`` [B, T] int32
  (1: placeholder row), ``positions`` [B, T], ``lengths`` [B], ``logit_index`` [B, G].
* ``step_inputs(...)`` (torch) lays out one step: catch-up rows then K-1 placeholders per sequence.

State: after a verify that kept m drafts, the target's features of the verified rows are fed as
catch-up rows (pairing g_p with the token at p+1) at the positions where the verify chunk began,
overwriting the slots the placeholders wrote; slots past a row's position are never read (causal
mask), so nothing is rolled back.
"""
from __future__ import annotations

import torch

from builder import functional as F
from builder.models.eagle3 import Eagle3Draft


class PEagleDraft(Eagle3Draft):
    kind = "peagle"

    def __init__(self, cfg, weights: dict, target_embedding=None, dtype=torch.float32):
        super().__init__(cfg, weights, target_embedding, dtype)
        self.mask_token_id = int(cfg.mask_token_id)
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.mask_hidden = weights["mask_hidden"].reshape(-1).to(dtype)  # [k*Ht]

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.aux_layer_ids

    def step_inputs(self, tokens, features, starts, num_draft_tokens: int, width: int = 0):
        """Chunk tensors of one step (torch): per sequence b the catch-up rows ``tokens[b]`` (ids of
        x_{p+1}) with ``features[b]`` [n_b, k*Ht] (g_p) at positions starts[b] + 0.., then K-1
        placeholders, right-padded to ``width`` rows at least (positions continue past a sequence's
        last row). Returns (input_ids, aux, is_mask, positions, lengths, logit_index)."""
        k = int(num_draft_tokens)
        batch = len(tokens)
        rows = [len(t) + k - 1 for t in tokens]
        width = max(rows + [width])
        ids = torch.zeros(batch, width, dtype=torch.int32)
        aux = torch.zeros(batch, width, self.aux_width, dtype=self.dtype)
        is_mask = torch.zeros(batch, width, dtype=torch.int32)
        index = torch.zeros(batch, k, dtype=torch.int32)
        for b, (t, f) in enumerate(zip(tokens, features)):
            n = len(t)
            ids[b, :n] = torch.as_tensor(t, dtype=torch.int32)
            aux[b, :n] = f[:n].to(self.dtype)
            is_mask[b, n:n + k - 1] = 1
            index[b] = torch.arange(n - 1, n - 1 + k, dtype=torch.int32)
        positions = torch.as_tensor(starts, dtype=torch.int32)[:, None] + torch.arange(width, dtype=torch.int32)
        return ids, aux, is_mask, positions, torch.tensor(rows, dtype=torch.int32), index

    def forward(self, input_ids, aux, is_mask, positions, lengths, logit_index, state: dict):
        """Returns (logits [B, G, draft_vocab] fp32, new state)."""
        ids = F.where(is_mask, self.mask_token_id, input_ids)
        a = F.where(F.reshape(is_mask, [0, 0, 1]), self.mask_hidden, aux)
        logits, _, new_state = self.decode(ids, self.fused_features(a), positions, logit_index, state)
        return logits, new_state
