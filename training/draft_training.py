"""One function per draft kind: build it from its speculators config, distill it, write it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from builder.checkpoint import load_checkpoint, mtp_tensors
from builder.draft_checkpoint import validate_against_target
from builder.draft_checkpoint_block import validate_block_draft
from builder.drafts import _block_draft, _feature_draft
from training import distill
from training.distill_data import DistillData
from training.draft_configs import (DFLASH_LAYERS, EAGLE3_LAYERS, NUM_SPECULATIVE_TOKENS, draft_config, draft_shapes,
                                    stored_name)

FEATURE_KINDS = ("eagle", "eagle3")
BLOCK_KINDS = ("dflash", "dspark", "peagle")
ALL_KINDS = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "peagle")
VALID_SEQUENCES = 64
DRAFT_TARGET_CONFIG = dict(hidden_size=128, num_hidden_layers=4, hybrid_override_pattern="M*M-",
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512,
                           mamba_num_heads=4, mamba_head_dim=64)


def _bf16_file(tensors: dict, path: Path) -> None:
    save_file({n: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
               for n, t in tensors.items()}, str(path), metadata={"format": "pt"})


def _features(kind: str, data: DistillData, hidden_size: int):
    if kind in ("eagle", "mtp"):
        return data.hidden
    return data.aux_for(DFLASH_LAYERS if kind in ("dflash", "dspark") else EAGLE3_LAYERS, hidden_size)


def _loss_and_eval(kind, module, data: DistillData, feats, batch: int, g: torch.Generator):
    limit = data.tokens.shape[0] - VALID_SEQUENCES
    k = NUM_SPECULATIVE_TOKENS
    valid = slice(limit, None)

    def run(idx, gen):
        t, lab, f = data.tokens[idx], data.labels[idx], feats[idx].float()
        if kind in ("eagle", "eagle3", "mtp"):
            return distill.chain_loss(module, kind, t, lab, f)
        if kind == "peagle":
            return distill.peagle_loss(module, t, lab, f, data.prompt_len, k, 8, gen)
        return distill.block_loss(module, t, f, data.prompt_len, k, 8, gen)

    def loss(step):
        return run(distill.batches(data, batch, g, limit), g)

    def evaluate():
        return run(torch.arange(data.tokens.shape[0])[valid], torch.Generator().manual_seed(0))
    return loss, evaluate


def _resumed(kind: str, directory: Path, shapes: dict) -> dict:
    """Trainable fp32 copies of a draft written earlier (canonical names), to continue training it."""
    from builder.draft_checkpoint import load_draft_checkpoint
    from builder.draft_checkpoint_block import load_block_draft_checkpoint
    _, stored = (load_draft_checkpoint if kind in FEATURE_KINDS else load_block_draft_checkpoint)(directory)
    return {n: stored[n].float().clone().requires_grad_(True) for n in shapes}


def train_speculators_draft(kind: str, target_dir: Path, data: DistillData, out: Path, steps: int, batch: int,
                            lr: float, seed: int, log=print, resume: bool = False) -> list[dict]:
    tcfg, tweights = load_checkpoint(target_dir)
    config = draft_config(kind, tcfg)
    cfg, shapes = draft_shapes(kind, config)
    cfg = validate_against_target(cfg, tcfg) if kind in FEATURE_KINDS else validate_block_draft(cfg, tcfg)
    weights = _resumed(kind, out, shapes) if resume else distill.init_weights(shapes, tweights, seed)
    module = (_feature_draft if kind in FEATURE_KINDS else _block_draft)(cfg, weights, tweights, torch.float32)
    params = [w for w in weights.values() if w.requires_grad]
    log(f"{kind}: {sum(p.numel() for p in params) / 1e6:.2f} M trainable parameters")
    loss, evaluate = _loss_and_eval(kind, module, data, _features(kind, data, tcfg.hidden_size), batch,
                                    torch.Generator().manual_seed(seed))
    curve = distill.train_draft(loss, params, steps, lr, kind, log, evaluate)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _bf16_file({stored_name(kind, n): w for n, w in weights.items()}, tmp / "model.safetensors")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return curve


def train_mtp(target_dir: Path, data: DistillData, out: Path, steps: int, batch: int, lr: float, seed: int,
              log=print) -> list[dict]:
    """MTP layers (attention + MoE, NemotronH's own layout) appended to a copy of the target."""
    from builder.models.mtp import MTPDraft
    from builder.random_checkpoint import add_mtp_layers

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(target_dir, tmp)
    add_mtp_layers(tmp, "*E", seed)
    cfg, weights = load_checkpoint(tmp)
    weights = {n: w.float() for n, w in weights.items()}
    g = torch.Generator().manual_seed(seed)
    for name, shape in mtp_tensors(cfg).items():
        leaf = name.rsplit(".", 1)[0]
        if "norm" in leaf:
            value = torch.ones(shape)
        elif "bias" in name:
            value = torch.zeros(shape)
        else:
            value = torch.randn(shape, generator=g) * 0.02
        weights[name] = value.requires_grad_(True)
    params = [w for n, w in weights.items() if n.startswith("mtp.")]
    log(f"mtp: {sum(p.numel() for p in params) / 1e6:.2f} M trainable parameters")

    class Rebuilt:
        """MTPDraft built anew for every forward: its MoE stacks the expert weights when it is
        constructed, and that stack must see (and pass gradients to) the current leaves."""
        def __getattr__(self, name):
            return getattr(MTPDraft(cfg, weights, torch.float32), name)

    loss, evaluate = _loss_and_eval("mtp", Rebuilt(), data, data.hidden, batch, torch.Generator().manual_seed(seed))
    curve = distill.train_draft(loss, params, steps, lr, "mtp", log, evaluate)
    save_file({n: w.detach().contiguous() for n, w in weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return curve


def train_draft_target(target_dir: Path, data: DistillData, out: Path, steps: int, batch: int, lr: float, seed: int,
                       log=print) -> list[dict]:
    """A smaller NemotronH (transformers) trained on the target's greedy labels."""
    from training.target import build_target

    model = build_target(seed, **DRAFT_TARGET_CONFIG)
    params = list(model.parameters())
    log(f"draft_target: {sum(p.numel() for p in params) / 1e6:.2f} M parameters")
    limit = data.tokens.shape[0] - VALID_SEQUENCES
    g = torch.Generator().manual_seed(seed)

    def run(idx):
        logits = model(input_ids=data.tokens[idx]).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data.labels[idx].reshape(-1))
        return ce, (logits.argmax(-1) == data.labels[idx]).float().mean().item()

    model.train()
    curve = distill.train_draft(lambda step: run(distill.batches(data, batch, g, limit)), params, steps, lr,
                                "draft_target", log, lambda: run(torch.arange(limit, data.tokens.shape[0])))
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(tmp))
    if (target_dir / "tokenizer.json").is_file():
        shutil.copy2(target_dir / "tokenizer.json", tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return curve
