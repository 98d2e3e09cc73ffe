"""Distillation data: the target's own greedy continuations of corpus prompts, with its features.

Drafts are judged on how often they agree with the target's greedy choice, so they learn from
sequences the target itself wrote (prompt from the corpus, continuation = target greedy). One
teacher-forced forward over each whole sequence then gives, per position p:

* ``labels[p]``  the target's argmax after x_0..x_p (= x_{p+1} inside the continuation),
* ``aux[p]``     the hidden states entering the captured layers (HF ``hidden_states`` ids),
* ``hidden[p]``  the post-final-norm hidden state (what eagle and mtp drafts read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from builder.checkpoint import load_checkpoint
from builder.models.nemotron_h import NemotronH
from runtime.generation import generate
from runtime.runner import TorchRunner
from runtime.state import allocate


@dataclass
class DistillData:
    tokens: torch.Tensor   # [N, T] int64
    labels: torch.Tensor   # [N, T] int64
    aux: torch.Tensor      # [N, T, len(capture_layers) * H] bf16 (kept small; cast per batch)
    hidden: torch.Tensor   # [N, T, H] bf16
    capture_layers: tuple[int, ...]
    prompt_len: int

    def aux_for(self, layer_ids, hidden_size: int) -> torch.Tensor:
        """The aux columns of ``layer_ids`` (a subset of ``capture_layers``, in that order)."""
        cols = [c for i in layer_ids
                for c in range(self.capture_layers.index(i) * hidden_size, (self.capture_layers.index(i) + 1) * hidden_size)]
        return self.aux[..., cols]

    def save(self, path) -> None:
        from safetensors.torch import save_file
        save_file({"tokens": self.tokens, "labels": self.labels, "aux": self.aux, "hidden": self.hidden},
                  str(path), metadata={"capture_layers": ",".join(map(str, self.capture_layers)),
                                       "prompt_len": str(self.prompt_len)})

    @classmethod
    def load(cls, path) -> "DistillData":
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        t = load_file(str(path))
        return cls(t["tokens"], t["labels"], t["aux"], t["hidden"],
                   tuple(int(i) for i in meta["capture_layers"].split(",")), int(meta["prompt_len"]))


def target_features(target_dir, tokens: torch.Tensor, capture_layers, batch: int = 32):
    """(labels, aux, hidden) of one teacher-forced forward per sequence of ``tokens`` [N, T]."""
    config, weights = load_checkpoint(target_dir)
    module = NemotronH(config, weights, torch.float32, final_hidden=True, capture_layers=tuple(capture_layers))
    labels, aux, hidden = [], [], []
    n, length = tokens.shape
    with torch.inference_mode():
        for s in range(0, n, batch):
            ids = tokens[s:s + batch].to(torch.int32)
            b = ids.shape[0]
            positions = torch.arange(length, dtype=torch.int32).repeat(b, 1)
            state = allocate(module.state_spec(b, length))
            logits, _, feats = module.forward(ids, positions, torch.full((b,), length, dtype=torch.int32),
                                              positions.clone(), state)
            labels.append(logits.argmax(-1))
            aux.append(feats["aux_hidden"].to(torch.bfloat16))
            hidden.append(feats["hidden"].to(torch.bfloat16))
    return torch.cat(labels), torch.cat(aux), torch.cat(hidden)


def make_distill_data(target_dir, stream: torch.Tensor, num_sequences: int, prompt_len: int, new_tokens: int,
                      capture_layers, seed: int, log=print, batch: int = 64) -> DistillData:
    """Corpus prompts (random windows of ``stream``) continued greedily by the target."""
    config, weights = load_checkpoint(target_dir)
    runner = TorchRunner(NemotronH(config, weights, torch.float32))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prompt_len - 1, (num_sequences,), generator=g).tolist()
    prompts = [stream[s:s + prompt_len].tolist() for s in starts]
    rows = []
    for s in range(0, num_sequences, batch):
        result = generate(runner, prompts[s:s + batch], new_tokens)
        rows.extend(p + o for p, o in zip(prompts[s:s + batch], result.output_ids))
        log(f"distillation data: {len(rows)}/{num_sequences} sequences generated")
    tokens = torch.tensor(rows, dtype=torch.long)
    labels, aux, hidden = target_features(target_dir, tokens, capture_layers)
    agree = (labels[:, prompt_len - 1:-1] == tokens[:, prompt_len:]).float().mean().item()
    log(f"distillation data: teacher-forced argmax equals the greedy continuation at {agree:.4f} of positions")
    return DistillData(tokens, labels, aux, hidden, tuple(capture_layers), prompt_len)
