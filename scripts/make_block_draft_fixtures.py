"""Write the tiny DFlash / DSpark / P-EAGLE draft fixtures and their reference outputs
(tests/fixtures/speculators), with speculators 0.9.0's own classes.

Run with the separate speculators venv, NOT the project's .venv (speculators needs numpy >= 2)::

    python3 -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install speculators==0.9.0 torch==2.13.0
    /tmp/specvenv/bin/pip uninstall -y torchvision torchaudio
    /tmp/specvenv/bin/python scripts/make_block_draft_fixtures.py [--out tests/fixtures/speculators]

Sibling of scripts/make_speculators_fixtures.py (EAGLE / EAGLE-3). Each fixture directory holds
``config.json`` + ``model.safetensors`` (bf16 weights) and ``reference.safetensors`` (fp32 inputs
chosen here and the reference outputs). ``tests/test_block_drafts.py`` (project venv, no
speculators) loads each with ``builder.draft_checkpoint_block`` and compares our drafts.

Fixtures (target: tests/tiny_models.py ``MOE``: hidden 32, vocab 96, 6 layers "ME*EM-"):

* ``dflash_speculators``: speculators ``dflash`` (``DFlashDraftModel.save_pretrained``), 2 Qwen3
  layers, GQA 2:1, block 4, aux ids [1, 3, 5], full vocabulary: no embedding and no LM head saved
  (the target's are used; stored in the reference as ``target_embedding`` / ``target_lm_head``).
* ``dspark_speculators``: speculators ``dspark``, 1 layer, draft vocab 64 with d2t/t2d (own
  reduced LM head), Markov rank 8 (vanilla), confidence head, sample_from_anchor (default true),
  aux ids [0, 2, 6] (the embeddings and the last layer's output included), llama3 rope scaling.
* ``dspark_zlab``: a speculators ``DSparkDraftModel`` with sample_from_anchor=false, Markov rank
  4, no confidence head, its own embedding and LM head, written in the z-lab / DeepSpec layout
  (``architectures: ["Qwen3DSparkModel"]``, ``dflash_config.target_layer_ids`` = layer outputs,
  i.e. aux ids - 1, fused ``qkv_proj`` / ``gate_up_proj``, ``model.`` prefix).
* ``peagle_speculators``: speculators ``peagle``, 1 llama layer, draft vocab 64 with d2t, own
  embedding, ``mask_hidden``, aux ids [1, 3, 4].

References
----------
DFlash/DSpark: ``_backbone_forward`` (and for DSpark the full ``forward``) with ``select_anchors``
replaced by fixed anchors; several anchors per sequence in one call (their blocks are independent
under speculators' anchor-block mask). Captured: the backbone logits (``lm_head`` output) and, for
DSpark, the logits handed to ``compute_metrics`` (backbone + Markov bias of the teacher-forced
previous tokens). Tensors: ``input_ids`` [B, T] int32 (right padded), ``aux`` [B, T, k*H],
``lengths`` [B], ``anchors`` [B, A] (anchor positions; the block of anchor a is x_a then mask
tokens at a+1 .. a+bs-1; its context is the aux rows 0 .. a-1), ``block_logits`` [B, A, bs, V]
and, DSpark, ``markov_logits`` [B, A, bs, V] (row k biased by ``prev_ids`` [B, A, bs]).

P-EAGLE: ``forward`` with ``generate_cod_sample_indices`` replaced by depth 0 = every row plus
depths 1..K-1 of fixed anchors, logits captured at ``compute_metrics``. Rows follow speculators'
shifted convention: row i pairs token ``input_ids[i]`` (x_{i+1}) with ``aux[i]`` (g_i) at position
i. ``logits`` [B, T, V] (depth 0), ``anchors`` [B, A], ``parallel_logits`` [B, A, K-1, V] (depth d
of anchor a: a mask row at position a+d).
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
import speculators.models.peagle.core as peagle_core
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
from speculators.models.peagle import PEagleSpeculatorConfig
from speculators.models.peagle.core import PEagleDraftModel
from speculators.proposals.greedy import GreedyTokenProposalConfig

HIDDEN, VOCAB, DRAFT_VOCAB = 32, 96, 64
LENGTHS = [8, 6]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-degenerate random weights, rounded to bf16 (the checkpoints store bf16)."""
    g = gen(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                v = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif p.dim() == 1:
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "embed" in name:
                v = torch.randn(p.shape, generator=g)
            elif "lm_head" in name:
                v = torch.randn(p.shape, generator=g) * (3.0 / p.shape[-1] ** 0.5)
            elif "markov_w2" in name:
                v = torch.randn(p.shape, generator=g) * (2.0 / p.shape[-1] ** 0.5)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(v.to(torch.bfloat16).float())


def vocab_map(seed: int):
    ids = torch.sort(torch.randperm(VOCAB, generator=gen(seed))[:DRAFT_VOCAB]).values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return t2d, d2t


def spec_config(algorithm: str, tokens: int) -> SpeculatorsConfig:
    return SpeculatorsConfig(
        algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["NemotronHForCausalLM"]))


def qwen3_layer(layers: int, **kw) -> Qwen3Config:
    params = kw.pop("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      max_position_embeddings=512, rope_parameters=params, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def padded(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros((len(rows), T) + tuple(rows[0].shape[1:]), dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def inputs(seed: int, width: int):
    g = gen(seed)
    ids = [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]
    feats = [torch.randn(n, width, generator=g) for n in LENGTHS]
    return max(LENGTHS), ids, feats


def save_speculators(model, out: Path) -> None:
    model = copy.deepcopy(model).to(torch.bfloat16)
    model.save_pretrained(str(out))
    for extra in out.iterdir():  # keep the fixture to the two files a checkpoint needs
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()


# --- DFlash / DSpark ---------------------------------------------------------------------------------
def block_reference(model, seed: int, anchors: list[list[int]], dspark: bool) -> dict[str, torch.Tensor]:
    """Per sequence one call with all its anchors; captures backbone and (DSpark) Markov logits."""
    model.eval()
    bs = model.block_size
    width = len(model.target_layer_ids) * HIDDEN
    T, ids, feats = inputs(seed, width)
    backbone, markov, prevs = [], [], []
    captured: dict[str, list] = {"lm": [], "metrics": []}
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured["lm"].append(o.detach().clone()))
    orig_select, orig_metrics = dflash_core.select_anchors, dspark_core.compute_metrics
    try:
        for b, n in enumerate(LENGTHS):
            anchor = torch.tensor(anchors[b])
            assert int(anchor.max()) + bs <= n, "a block must fit inside the sequence (targets are indexed)"
            dflash_core.select_anchors = lambda loss_mask, num, block, a=anchor: (a.clone(), torch.ones(len(a), dtype=torch.bool))

            def metrics(logits, *args, **kwargs):
                captured["metrics"].append(logits.detach().clone())
                return torch.zeros(()), {}
            dspark_core.compute_metrics = metrics
            for v in captured.values():
                v.clear()
            kwargs = dict(hidden_states=feats[b][None], input_ids=ids[b][None], loss_mask=torch.ones(1, n),
                          verifier_last_hidden_states=torch.randn(1, n, HIDDEN, generator=gen(seed + b)),
                          document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None],
                          max_anchors=len(anchor))
            with torch.no_grad():
                if dspark:
                    model(**kwargs)
                else:
                    model._backbone_forward(**kwargs)
            backbone.append(captured["lm"][0][0].reshape(len(anchor), bs, -1))
            if dspark:
                markov.append(captured["metrics"][0][0].reshape(len(anchor), bs, -1))
                block_tokens = ids[b][anchor[:, None] + torch.arange(bs)]  # teacher-forced block tokens
                prev = block_tokens if model.config.sample_from_anchor else torch.cat(
                    [block_tokens[:, :1], block_tokens[:, :-1]], dim=1)
                prevs.append(prev)
    finally:
        hook.remove()
        dflash_core.select_anchors, dspark_core.compute_metrics = orig_select, orig_metrics
    ref = {"input_ids": padded(ids, T).int(), "aux": padded(feats, T),
           "lengths": torch.tensor(LENGTHS, dtype=torch.int32), "anchors": torch.tensor(anchors, dtype=torch.int32),
           "block_logits": torch.stack(backbone)}
    if dspark:
        ref["markov_logits"] = torch.stack(markov)
        ref["prev_ids"] = torch.stack(prevs).int()
    return ref


def check_roundtrip(cls, model, out: Path, reference: dict) -> None:
    """speculators itself loads the written checkpoint and reproduces the backbone logits (the
    target's embedding / LM head, not saved, are copied over)."""
    loaded = cls.from_pretrained(str(out), local_files_only=True).float().eval()
    with torch.no_grad():
        loaded.embed_tokens.weight.copy_(model.embed_tokens.weight)
        if loaded.lm_head.weight.isnan().any():
            loaded.lm_head.weight.copy_(model.lm_head.weight)
    loaded.config.transformer_layer_config._attn_implementation = "eager"
    loaded._create_mask_fn = model._create_mask_fn
    for layer in loaded.layers:
        layer.self_attn.config._attn_implementation = "eager"
    b, n = 0, LENGTHS[0]
    anchor = reference["anchors"][b].long()
    got = []
    hook = loaded.lm_head.register_forward_hook(lambda m, i, o: got.append(o))
    orig = dflash_core.select_anchors
    dflash_core.select_anchors = lambda loss_mask, num, block: (anchor.clone(), torch.ones(len(anchor), dtype=torch.bool))
    try:
        with torch.no_grad():
            loaded._backbone_forward(
                hidden_states=reference["aux"][:1, :n], input_ids=reference["input_ids"][:1, :n].long(),
                loss_mask=torch.ones(1, n), verifier_last_hidden_states=torch.zeros(1, n, HIDDEN),
                document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None],
                max_anchors=len(anchor))
    finally:
        dflash_core.select_anchors = orig
        hook.remove()
    torch.testing.assert_close(got[0][0].reshape(reference["block_logits"][b].shape), reference["block_logits"][b],
                               rtol=1e-5, atol=1e-5)


def make_dflash_speculators(out: Path) -> None:
    config = DFlashSpeculatorConfig(
        transformer_layer_config=qwen3_layer(2), draft_vocab_size=VOCAB, block_size=4,
        target_hidden_size=HIDDEN, aux_hidden_state_layer_ids=[1, 3, 5], mask_token_id=95,
        speculators_config=spec_config("dflash", 3))
    model = DFlashDraftModel(config)
    randomize(model, 61)
    ref = block_reference(model, 62, [[4, 2], [2, 1]], dspark=False)
    ref["target_embedding"] = model.embed_tokens.weight.detach().to(torch.bfloat16)
    ref["target_lm_head"] = model.lm_head.weight.detach().to(torch.bfloat16)
    save_speculators(model, out)
    check_roundtrip(DFlashDraftModel, model, out, ref)
    save_file(ref, str(out / "reference.safetensors"))


def make_dspark_speculators(out: Path) -> None:
    layer = qwen3_layer(1, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8})
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, block_size=4, target_hidden_size=HIDDEN,
        aux_hidden_state_layer_ids=[0, 2, 6], mask_token_id=90, markov_rank=8, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True, speculators_config=spec_config("dspark", 4))
    model = DSparkDraftModel(config)
    randomize(model, 71)
    t2d, d2t = vocab_map(71)
    model.load_vocab_mappings(t2d, d2t)
    ref = block_reference(model, 72, [[4, 1], [2, 0]], dspark=True)
    ref["target_embedding"] = model.embed_tokens.weight.detach().to(torch.bfloat16)
    save_speculators(model, out)
    check_roundtrip(DSparkDraftModel, model, out, ref)
    save_file(ref, str(out / "reference.safetensors"))


def make_dspark_zlab(out: Path) -> None:
    ids = [2, 4, 5]
    config = DSparkSpeculatorConfig(
        transformer_layer_config=qwen3_layer(1), draft_vocab_size=VOCAB, block_size=4, target_hidden_size=HIDDEN,
        aux_hidden_state_layer_ids=ids, mask_token_id=94, markov_rank=4, markov_head_type="vanilla",
        enable_confidence_head=False, confidence_head_with_markov=False, sample_from_anchor=False,
        speculators_config=spec_config("dspark", 3))
    model = DSparkDraftModel(config)
    randomize(model, 81)
    ref = block_reference(model, 82, [[4, 3], [2, 1]], dspark=True)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    tensors = {}
    for name, value in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            k, v = sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]
            name, value = name.replace("q_proj", "qkv_proj"), torch.cat([value, k, v])
        elif ".mlp.gate_proj." in name:
            name, value = name.replace("gate_proj", "gate_up_proj"), torch.cat([value, sd[name.replace("gate", "up")]])
        stored = name if name.startswith("lm_head") else "model." + name
        tensors[stored] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    cfg = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": HIDDEN,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "bfloat16", "num_target_layers": 6, "target_hidden_size": HIDDEN,
        "dflash_config": {"target_layer_ids": [i - 1 for i in ids], "mask_token_id": 94, "block_size": 4},
        "markov_rank": 4, "markov_head_type": "vanilla", "enable_confidence_head": False,
        "sample_from_anchor": False,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(ref, str(out / "reference.safetensors"))


# --- P-EAGLE --------------------------------------------------------------------------------------------
def peagle_reference(model: PEagleDraftModel, seed: int, anchors: list[list[int]], depths: int):
    model.eval()
    width = len(model.config.eagle_aux_hidden_state_layer_ids) * HIDDEN
    T, ids, feats = inputs(seed, width)
    depth0, parallel = [], []
    captured = []
    orig_cod, orig_metrics = peagle_core.generate_cod_sample_indices, peagle_core.compute_metrics

    def metrics(logits, *args, **kwargs):
        captured.append(logits.detach().clone())
        return torch.zeros(()), {}
    try:
        peagle_core.compute_metrics = metrics
        for b, n in enumerate(LENGTHS):
            a = torch.tensor(anchors[b])
            assert int(a.max()) + depths - 1 < n
            anchor_pos = torch.cat([torch.arange(n)] + [a] * (depths - 1))
            depth = torch.cat([torch.zeros(n, dtype=torch.long)]
                              + [torch.full((len(a),), d, dtype=torch.long) for d in range(1, depths)])
            peagle_core.generate_cod_sample_indices = lambda *args, p=anchor_pos, d=depth, **kw: (p.clone(), d.clone())
            captured.clear()
            with torch.no_grad():
                model(hidden_states=feats[b][None], input_ids=ids[b][None],
                      document_ids=torch.zeros(1, n, dtype=torch.long), loss_mask=torch.ones(1, n),
                      verifier_last_hidden_states=torch.randn(1, n, HIDDEN, generator=gen(seed + b)),
                      num_depths=depths)
            logits = captured[0][0]
            depth0.append(logits[:n])
            parallel.append(logits[n:].reshape(depths - 1, len(a), -1).transpose(0, 1))  # [A, K-1, V]
    finally:
        peagle_core.generate_cod_sample_indices, peagle_core.compute_metrics = orig_cod, orig_metrics
    return {"input_ids": padded(ids, T).int(), "aux": padded(feats, T),
            "lengths": torch.tensor(LENGTHS, dtype=torch.int32),
            "positions": torch.arange(T, dtype=torch.int32).repeat(len(LENGTHS), 1),
            "logits": padded(depth0, T), "anchors": torch.tensor(anchors, dtype=torch.int32),
            "parallel_logits": torch.stack(parallel)}


def make_peagle_speculators(out: Path) -> None:
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layer._attn_implementation = "eager"
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=DRAFT_VOCAB, eagle_aux_hidden_state_layer_ids=[1, 3, 4],
        mask_token_id=93, speculators_config=spec_config("peagle", 3))
    model = PEagleDraftModel(config)
    randomize(model, 91)
    t2d, d2t = vocab_map(91)
    model.load_vocab_mappings(t2d, d2t)
    ref = peagle_reference(model, 92, [[5, 2], [3, 1]], depths=3)
    save_speculators(model, out)
    save_file(ref, str(out / "reference.safetensors"))


FIXTURES = {
    "dflash_speculators": make_dflash_speculators,
    "dspark_speculators": make_dspark_speculators,
    "dspark_zlab": make_dspark_zlab,
    "peagle_speculators": make_peagle_speculators,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speculators"))
    parser.add_argument("--only", nargs="*", default=None, help="fixture names to (re)write")
    args = parser.parse_args()
    torch.manual_seed(0)
    root = Path(args.out)
    total = 0
    for name, make in FIXTURES.items():
        if args.only and name not in args.only:
            continue
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        make(out)
        load_file(str(out / "reference.safetensors"))  # readable
        size = sum(p.stat().st_size for p in out.iterdir())
        total += size
        print(f"{name}: {size / 1024:.1f} KiB")
    print(f"total: {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
