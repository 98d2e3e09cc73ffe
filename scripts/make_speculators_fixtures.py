"""Write the tiny EAGLE-3 / EAGLE draft fixtures and their reference outputs (tests/fixtures/speculators).

Run with the separate speculators venv, NOT the project's .venv (speculators needs numpy >= 2)::

    python3 -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install speculators==0.9.0 torch==2.13.0
    /tmp/specvenv/bin/pip uninstall -y torchvision torchaudio
    /tmp/specvenv/bin/python scripts/make_speculators_fixtures.py [--out tests/fixtures/speculators]

Each fixture directory holds ``config.json`` + ``model.safetensors`` (bf16 weights, as real drafts
ship) in one checkpoint layout, and ``reference.safetensors`` (fp32): the inputs chosen here and the
reference forward's outputs for them. ``tests/test_eagle_drafts.py`` (project venv, no speculators)
loads each with ``builder.draft_checkpoint`` and compares our eager draft with these outputs.

Fixtures (target: tests/tiny_models.py ``MOE``: hidden 32, vocab 96, 6 layers):

* ``eagle3_llama3`` speculators ``eagle3`` (``Eagle3DraftModel.save_pretrained``), llama layer,
  llama3 rope scaling, own embedding, draft vocab 64 with d2t/t2d, aux ids [1, 3, 4].
* ``eagle3_qwen3`` speculators ``eagle3``, 2 qwen3 layers (q/k norm), GQA 4:1,
  norm_before_residual, fc_norm, norm_output, full vocab (no d2t).
* ``eagle3_specforge`` the original EAGLE-3 / SpecForge layout (``LlamaForCausalLMEagle3``,
  ``midlayer.*``, no embedding: the target's), converted from a speculators ``Eagle3DraftModel``.
* ``eagle_speculators`` the speculators ``eagle`` layout (EAGLE-1 / HASS: ``fusion_fc`` with bias,
  ``layernorms``), linear rope scaling.
* ``eagle_hf`` the original EAGLE / SGLang ``LlamaForCausalLMEagle`` layout: ``fc`` with bias, two
  layers, layer 0 without input_layernorm, no final norm, the target's embedding and LM head.

EAGLE-3 references come from speculators' own ``Eagle3DraftModel.forward`` with 3 TTT steps
(step 1: rows from the target's aux states; steps 2-3: each row fed its own previous hidden output,
attending to step-1 rows up to itself plus its own chain), captured by hooks on ``lm_head`` and
``norm``. speculators 0.9.0 has no EAGLE-1 class (its ``eagle`` type was dropped), so EAGLE-1
references are computed here from transformers' ``LlamaDecoderLayer`` / ``LlamaRMSNorm`` /
``LlamaRotaryEmbedding`` wired as speculators' former ``EagleSpeculator.forward`` and vLLM's
``llama_eagle`` wire them; chain steps are full causal recomputations of the extended sequence.

Reference tensors: ``input_ids`` [B, T] int32 (right padded), ``aux`` [B, T, 3H] (eagle3) or
``hidden`` [B, T, H] (eagle), ``positions`` [B, T], ``lengths`` [B], ``logits`` [B, T, V] and
``hidden_out`` [B, T, H] (padding rows zero); chains ``chain_rows`` [B, R] (row i of sequence b),
``chain_ids`` [B, R, S] (tokens of chain steps 1..S after row i; positions p_i + 1 ..),
``chain_logits`` [B, R, S, V], ``chain_hidden`` [B, R, S, H]; ``target_embedding`` and
``target_lm_head`` (bf16, exact: the weights are bf16 values) where the draft uses the target's.
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
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig

HIDDEN, VOCAB, DRAFT_VOCAB = 32, 96, 64
AUX_IDS = [1, 3, 4]
LENGTHS = [6, 4]
TTT_STEPS = 3


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
                v = torch.randn(p.shape, generator=g) * (3.0 / p.shape[1] ** 0.5)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
            p.copy_(v.to(torch.bfloat16).float())


def bf16(t):
    return t.to(torch.bfloat16).float()


def vocab_map(seed: int):
    ids = torch.sort(torch.randperm(VOCAB, generator=gen(seed))[:DRAFT_VOCAB]).values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return t2d, d2t


def speculators_config(layer_config, **kw) -> Eagle3SpeculatorConfig:
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, eagle_aux_hidden_state_layer_ids=list(AUX_IDS),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["NemotronHForCausalLM"])),
        **kw)


def padded(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros((len(rows), T) + tuple(rows[0].shape[1:]), dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, :r.shape[0]] = r
    return out


def common_inputs(seed: int, width: int):
    g = gen(seed)
    T = max(LENGTHS)
    ids = [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]
    feats = [torch.randn(n, width, generator=g) for n in LENGTHS]
    return T, ids, feats


# --- EAGLE-3 through speculators -----------------------------------------------------------------
def eagle3_reference(model: Eagle3DraftModel, seed: int) -> dict[str, torch.Tensor]:
    model.eval()
    T, ids, feats = common_inputs(seed, len(AUX_IDS) * HIDDEN)
    captured = {"ids": [], "logits": [], "hidden": []}
    hooks = [
        model.embed_tokens.register_forward_hook(lambda m, i, o: captured["ids"].append(i[0].clone())),
        model.lm_head.register_forward_hook(lambda m, i, o: captured["logits"].append(o.clone())),
        model.norm.register_forward_hook(
            lambda m, i, o: captured["hidden"].append((o if model.config.norm_output else i[0]).clone())),
    ]
    logits, hidden_out, chain_ids, chain_logits, chain_hidden, rows = [], [], [], [], [], []
    for b, n in enumerate(LENGTHS):
        for v in captured.values():
            v.clear()
        with torch.no_grad():
            model(hidden_states=feats[b][None], input_ids=ids[b][None],
                  document_ids=torch.zeros(1, n, dtype=torch.long),
                  position_ids=torch.arange(n)[None], ttt_steps=TTT_STEPS)
        assert len(captured["logits"]) == TTT_STEPS and len(captured["hidden"]) == TTT_STEPS
        logits.append(captured["logits"][0][0])
        hidden_out.append(captured["hidden"][0][0])
        pick = [n - 1, n - 2]  # rows whose chains are checked (the last row, and one before it)
        rows.append(torch.tensor(pick))
        chain_ids.append(torch.stack([torch.stack([captured["ids"][s][0, i] for s in range(1, TTT_STEPS)])
                                      for i in pick]))
        chain_logits.append(torch.stack([torch.stack([captured["logits"][s][0, i] for s in range(1, TTT_STEPS)])
                                         for i in pick]))
        chain_hidden.append(torch.stack([torch.stack([captured["hidden"][s][0, i] for s in range(1, TTT_STEPS)])
                                         for i in pick]))
    for h in hooks:
        h.remove()
    return {
        "input_ids": padded(ids, T).int(), "aux": padded(feats, T), "lengths": torch.tensor(LENGTHS, dtype=torch.int32),
        "positions": torch.arange(T, dtype=torch.int32).repeat(len(LENGTHS), 1),
        "logits": padded(logits, T), "hidden_out": padded(hidden_out, T),
        "chain_rows": torch.stack(rows).int(), "chain_ids": torch.stack(chain_ids).int(),
        "chain_logits": torch.stack(chain_logits), "chain_hidden": torch.stack(chain_hidden),
    }


def build_eagle3(layer_config, seed: int, draft_vocab: int, **kw) -> Eagle3DraftModel:
    layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel(speculators_config(layer_config, draft_vocab_size=draft_vocab, **kw))
    randomize(model, seed)
    if draft_vocab != VOCAB:
        t2d, d2t = vocab_map(seed)
        model.load_vocab_mappings(t2d, d2t)
    return model


def save_speculators(model: Eagle3DraftModel, out: Path) -> None:
    model = copy.deepcopy(model).to(torch.bfloat16)
    model.save_pretrained(str(out))
    for extra in out.iterdir():  # keep the fixture to the two files a checkpoint needs
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()


def check_roundtrip(out: Path, reference: dict) -> None:
    """speculators itself loads the written checkpoint and reproduces the step-1 logits."""
    original = Eagle3DraftModel.load_verifier_weights
    Eagle3DraftModel.load_verifier_weights = lambda self: None  # no verifier to read offline
    try:
        loaded = Eagle3DraftModel.from_pretrained(str(out), local_files_only=True).float().eval()
    finally:
        Eagle3DraftModel.load_verifier_weights = original
    # (loaded with speculators' default simple_flex_attention: a second attention path checked too)
    n = LENGTHS[0]
    got = []
    hook = loaded.lm_head.register_forward_hook(lambda m, i, o: got.append(o))
    with torch.no_grad():
        loaded(hidden_states=reference["aux"][:1, :n], input_ids=reference["input_ids"][:1, :n].long(),
               document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None], ttt_steps=1)
    hook.remove()
    torch.testing.assert_close(got[0][0], reference["logits"][0, :n], rtol=1e-5, atol=1e-5)


def make_eagle3_llama3(out: Path) -> None:
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                        max_position_embeddings=512,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8})
    model = build_eagle3(layer, 11, DRAFT_VOCAB)
    ref = eagle3_reference(model, 12)
    save_speculators(model, out)
    check_roundtrip(out, ref)
    save_file(ref, str(out / "reference.safetensors"))


def make_eagle3_qwen3(out: Path) -> None:
    layer = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                        max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    model = build_eagle3(layer, 21, VOCAB, norm_before_residual=True, fc_norm=True, norm_output=True)
    ref = eagle3_reference(model, 22)
    save_speculators(model, out)
    check_roundtrip(out, ref)
    save_file(ref, str(out / "reference.safetensors"))


def make_eagle3_specforge(out: Path) -> None:
    layer = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
                        max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = build_eagle3(layer, 31, DRAFT_VOCAB)
    ref = eagle3_reference(model, 32)
    ref["target_embedding"] = model.embed_tokens.weight.detach().to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.startswith(("verifier_", "embed_tokens")):
            continue
        name = "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
        tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 2048, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS),
                                                   "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(ref, str(out / "reference.safetensors"))


# --- EAGLE-1 from transformers building blocks ---------------------------------------------------
class EagleReference(torch.nn.Module):
    """EAGLE-1/2: fc(concat(embed, hidden)) -> Llama layers (layer 0 without input norm unless
    ``layernorms``) -> [pre-LM-head norm] -> LM head; as speculators' former EagleSpeculator."""

    def __init__(self, config: LlamaConfig, fc_bias: bool, layernorms: bool, embedding, lm_head):
        super().__init__()
        config._attn_implementation = "eager"
        self.config = config
        H = config.hidden_size
        self.embedding_layernorm = LlamaRMSNorm(H, eps=config.rms_norm_eps) if layernorms else None
        self.fc = torch.nn.Linear(2 * H, H, bias=fc_bias)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, layer_idx=i)
                                          for i in range(config.num_hidden_layers))
        if not layernorms:
            self.layers[0].input_layernorm = torch.nn.Identity()
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps) if layernorms else None
        self.rotary = LlamaRotaryEmbedding(config)
        self.embedding, self.lm_head = embedding, lm_head

    def forward(self, ids, hidden, positions):
        """One sequence (batch 1), full causal attention; returns (logits, hidden_out)."""
        e = torch.nn.functional.embedding(ids[None], self.embedding)
        if self.embedding_layernorm is not None:
            e = self.embedding_layernorm(e)
        x = self.fc(torch.cat([e, hidden[None]], dim=-1))
        n = ids.shape[0]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x, positions[None])
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions[None], position_embeddings=cos_sin)
        h = x if self.norm is None else self.norm(x)
        return torch.nn.functional.linear(h, self.lm_head)[0], x[0]


def eagle_reference(model: EagleReference, seed: int) -> dict[str, torch.Tensor]:
    model.eval()
    T, ids, feats = common_inputs(seed, HIDDEN)
    g = gen(seed + 1)
    logits, hidden_out, rows, chain_ids, chain_logits, chain_hidden = [], [], [], [], [], []
    with torch.no_grad():
        for b, n in enumerate(LENGTHS):
            pos = torch.arange(n)
            lg, hid = model(ids[b], feats[b], pos)
            logits.append(lg)
            hidden_out.append(hid)
            pick = [n - 1, n - 2]
            rows.append(torch.tensor(pick))
            per_row = ([], [], [])
            for i in pick:
                seq_ids, seq_hidden = list(ids[b][:i + 1]), list(feats[b][:i + 1])
                prev = hid[i]
                tokens = torch.randint(1, VOCAB, (TTT_STEPS - 1,), generator=g)
                step_logits, step_hidden = [], []
                for tok in tokens:
                    seq_ids.append(tok)
                    seq_hidden.append(prev)
                    lg2, hid2 = model(torch.stack(seq_ids), torch.stack(seq_hidden), torch.arange(len(seq_ids)))
                    step_logits.append(lg2[-1])
                    step_hidden.append(hid2[-1])
                    prev = hid2[-1]
                per_row[0].append(tokens)
                per_row[1].append(torch.stack(step_logits))
                per_row[2].append(torch.stack(step_hidden))
            chain_ids.append(torch.stack(per_row[0]))
            chain_logits.append(torch.stack(per_row[1]))
            chain_hidden.append(torch.stack(per_row[2]))
    return {
        "input_ids": padded(ids, T).int(), "hidden": padded(feats, T),
        "lengths": torch.tensor(LENGTHS, dtype=torch.int32),
        "positions": torch.arange(T, dtype=torch.int32).repeat(len(LENGTHS), 1),
        "logits": padded(logits, T), "hidden_out": padded(hidden_out, T),
        "chain_rows": torch.stack(rows).int(), "chain_ids": torch.stack(chain_ids).int(),
        "chain_logits": torch.stack(chain_logits), "chain_hidden": torch.stack(chain_hidden),
        "target_embedding": model.embedding.to(torch.bfloat16), "target_lm_head": model.lm_head.to(torch.bfloat16),
    }


def target_head(seed: int):
    g = gen(seed)
    return (bf16(torch.randn(VOCAB, HIDDEN, generator=g)),
            bf16(torch.randn(VOCAB, HIDDEN, generator=g) * (3.0 / HIDDEN ** 0.5)))


def _layer_tensors(model: EagleReference, rename) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        if name.startswith("rotary") or name in ("embedding", "lm_head"):
            continue
        new = rename(name)
        if new is not None:
            out[new] = value.to(torch.bfloat16)
    return out


def make_eagle_speculators(out: Path) -> None:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         max_position_embeddings=1024,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    embedding, lm_head = target_head(41)
    model = EagleReference(config, fc_bias=True, layernorms=True, embedding=embedding, lm_head=lm_head)
    randomize(model, 42)
    ref = eagle_reference(model, 43)
    out.mkdir(parents=True, exist_ok=True)
    names = {"embedding_layernorm.": "embedding_layernorm.", "fc.": "fusion_fc.", "layers.0.": "transformer.",
             "norm.": "pre_lm_head_layernorm."}

    def rename(name):
        for old, new in names.items():
            if name.startswith(old):
                return new + name[len(old):]
        raise AssertionError(name)
    save_file(_layer_tensors(model, rename), str(out / "model.safetensors"))
    layer = config.to_diff_dict()
    layer.pop("_attn_implementation", None)
    layer.pop("transformers_version", None)
    cfg = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
        "speculators_version": "0.1.0", "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer, "layernorms": True, "fusion_bias": True, "dtype": "bfloat16",
        "speculators_config": {
            "algorithm": "eagle", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "verifier": {"name_or_path": None, "architectures": ["NemotronHForCausalLM"]}},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(ref, str(out / "reference.safetensors"))


def make_eagle_hf(out: Path) -> None:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6,
                         max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    embedding, lm_head = target_head(51)
    model = EagleReference(config, fc_bias=True, layernorms=False, embedding=embedding, lm_head=lm_head)
    randomize(model, 52)
    ref = eagle_reference(model, 53)
    out.mkdir(parents=True, exist_ok=True)
    save_file(_layer_tensors(model, lambda n: n), str(out / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": 2048, "vocab_size": VOCAB, "bias": True, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(ref, str(out / "reference.safetensors"))


FIXTURES = {
    "eagle3_llama3": make_eagle3_llama3,
    "eagle3_qwen3": make_eagle3_qwen3,
    "eagle3_specforge": make_eagle3_specforge,
    "eagle_speculators": make_eagle_speculators,
    "eagle_hf": make_eagle_hf,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "speculators"))
    args = parser.parse_args()
    torch.manual_seed(0)
    root = Path(args.out)
    total = 0
    for name, make in FIXTURES.items():
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
