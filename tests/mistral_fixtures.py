"""EagleMistralForCausalLM drafts written in both published layouts, by our own code (nothing downloaded).

* Hugging Face: ``config.json`` (``architectures: ["EagleMistralForCausalLM"]``, ``model_type: mistral``)
  + ``model.safetensors`` with ``model.fc.weight``, ``model.layers.N.*``, ``model.norm.weight``;
* Mistral native: ``params.json`` + ``consolidated.safetensors`` (``eagle_linear.weight``,
  ``layers.N.attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``,
  ``norm``), wq/wk rows in Mistral's interleaved RoPE order.

Two drafts: :func:`random_draft` (scaled down, for the transformers oracle and the bad-input
checks) and :func:`embedded_draft`, converted from the embedded trained EAGLE draft, whose decoder
layer, fc and final norm have the same shapes. EagleMistral has no embedding norm and no fc bias, so
the conversion folds the embedding RMSNorm's weight into fc's embedding columns with the target
embedding's mean inverse RMS, and drops the bias: an approximation of the trained draft, not the same
function (measured: accepted as well as the original, 2.35 vs 2.24 tokens per step at K=4).

``python tests/mistral_fixtures.py OUT_DIR`` writes ``OUT_DIR/{hf,native}`` of the embedded draft.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder import embedded  # noqa: E402
from builder.formats.mistral import half_to_interleaved, stored_native_name  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=96)


def hf_config(dims: dict) -> dict:
    return {"architectures": ["EagleMistralForCausalLM"], "model_type": "mistral", **dims, "hidden_act": "silu",
            "max_position_embeddings": 4096, "sliding_window": None, "tie_word_embeddings": False,
            "dtype": "float32"}


def random_draft(dims: dict = SMALL, seed: int = 0) -> tuple[dict, dict]:
    """(HF config, canonical name -> fp32 tensor) of a random draft; norms away from 1."""
    g = torch.Generator().manual_seed(seed)
    H, I, D = dims["hidden_size"], dims["intermediate_size"], dims["head_dim"]
    q, kv = dims["num_attention_heads"] * D, dims["num_key_value_heads"] * D
    w = {"fc.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5,
         "norm.weight": 1 + 0.2 * torch.randn(H, generator=g)}
    for i in range(dims["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, shape in ((p + "self_attn.q_proj.weight", (q, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                            (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, q)),
                            (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                            (p + "mlp.down_proj.weight", (H, I))):
            w[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            w[p + name] = 1 + 0.2 * torch.randn(H, generator=g)
    return hf_config(dims), w


def embedded_draft() -> tuple[dict, dict]:
    """(HF config, canonical name -> fp32 tensor) converted from the embedded EAGLE draft."""
    src = embedded.draft_dir("eagle")
    layer = json.loads((src / "config.json").read_text())["transformer_layer_config"]
    w = {n: t.float() for n, t in load_file(str(src / "model.safetensors")).items()}
    emb = load_file(str(embedded.target_dir() / "model.safetensors"))["backbone.embeddings.weight"].float()
    H = layer["hidden_size"]
    inv_rms = emb.pow(2).mean(-1).add(layer["rms_norm_eps"]).rsqrt().mean()
    fc = w["fusion_fc.weight"].clone()
    fc[:, :H] *= w["embedding_layernorm.weight"] * inv_rms
    out = {"fc.weight": fc, "norm.weight": w["pre_lm_head_layernorm.weight"]}
    out.update({"layers.0." + n[len("transformer."):]: t for n, t in w.items() if n.startswith("transformer.")})
    dims = {k: layer[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "rms_norm_eps", "vocab_size")}
    return hf_config(dict(dims, num_hidden_layers=1, rope_theta=layer["rope_parameters"]["rope_theta"])), out


def swap_fc_halves(weights: dict) -> dict:
    fc = weights["fc.weight"]
    H = fc.shape[0]
    return dict(weights, **{"fc.weight": torch.cat([fc[:, H:], fc[:, :H]], dim=1)})


def write_hf(directory: Path, config: dict, weights: dict, dtype=torch.bfloat16) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({"model." + n: t.to(dtype).contiguous() for n, t in weights.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def write_native(directory: Path, config: dict, weights: dict, dtype=torch.bfloat16) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    params = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "head_dim": config["head_dim"],
              "hidden_dim": config["intermediate_size"], "n_heads": config["num_attention_heads"],
              "n_kv_heads": config["num_key_value_heads"], "norm_eps": config["rms_norm_eps"],
              "vocab_size": config["vocab_size"], "rope_theta": config["rope_theta"], "tied_embeddings": False}
    (directory / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    tensors = {}
    for name, t in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            t = half_to_interleaved(t, heads)
        tensors[stored_native_name(name)] = t.to(dtype).contiguous()
    save_file(tensors, str(directory / "consolidated.safetensors"))
    return directory


if __name__ == "__main__":
    out = Path(sys.argv[1])
    config, weights = embedded_draft()
    write_hf(out / "hf", config, weights)
    write_native(out / "native", config, weights)
    print(f"wrote {out}/hf and {out}/native")
