"""A NemotronH checkpoint (ours: Mamba-2, attention, dense relu2 MLP and MoE layers mixed) as a GGUF
file stock llama.cpp loads, for the llama.cpp peer (``benchmarks/llama_cpp_peer.py``).

llama.cpp's ``nemotron_h_moe`` graph takes a layer's kind from per-layer arrays (``head_count_kv`` and
``feed_forward_length`` zero: Mamba; ``feed_forward_length`` zero: attention; else FFN), but its
loader makes every FFN layer a MoE layer once ``expert_count`` is set, so a file cannot hold a dense
MLP beside a MoE layer. A dense relu2 MLP of D units is written, exactly, as a MoE layer that always
routes to one expert: units [0, S) become the shared expert (S: the shared expert's width), units
[S, D) routed expert 0 (``expert_feed_forward_length`` D - S for that layer), the router's weights
zero (every sigmoid score 0.5) with a selection bias of 1 on expert 0, top-1, normalised: expert 0
weighs exactly 1.0 and relu2 splits over units, so shared + expert 0 is the dense MLP. A decode
streams the same D units as the dense MLP; the never-routed experts 1.. cost file bytes only.

``plan`` is pure numpy (tested in the project's venv); ``write`` needs the ``gguf`` package and runs
in the peer's own venv (numpy >= 2):

    python benchmarks/llama_cpp_gguf.py --checkpoint_dir DIR --output FILE.gguf [--dtype f32|bf16|f16]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ARCH = "nemotron_h_moe"
BLOCK = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
         "mlp": "mlp", "moe": "moe"}


@dataclass
class Plan:
    """What one GGUF file holds: typed metadata (key without the ``ARCH.`` prefix where ``arch``) and
    tensors in llama.cpp's names and numpy shapes, each marked whether it must stay float32."""
    metadata: list = field(default_factory=list)     # (key, value, type) with type in u32 f32 bool ints str
    tensors: list = field(default_factory=list)      # (name, array, keep_f32)

    def meta(self, key, value, kind):
        self.metadata.append((key, value, kind))

    def tensor(self, name, array, keep_f32=False):
        self.tensors.append((name, np.ascontiguousarray(array, dtype=np.float32), keep_f32))


def _kinds(config: dict) -> list[str]:
    types = config.get("layers_block_type")
    if types is None:
        raise ValueError("config.json: layers_block_type missing (expected the NemotronH layer list)")
    unknown = [t for t in types if t not in BLOCK]
    if unknown:
        raise ValueError(f"config.json: layers_block_type holds {unknown[0]!r}, expected one of {sorted(BLOCK)}")
    return [BLOCK[t] for t in types]


def dense_as_routed(up: np.ndarray, down: np.ndarray, shared: int, experts: int):
    """A dense relu2 MLP (``up`` [D, n], ``down`` [n, D]) as (shared up, shared down, expert ups
    [E, D - S, n], expert downs [E, n, D - S], router weight [E, n], selection bias [E]): expert 0
    holds units [S, D) and is the only one ever chosen."""
    d = up.shape[0]
    if not 0 < shared < d:
        raise ValueError(f"a dense MLP of {d} units cannot split around a shared expert of {shared} units")
    ups = np.zeros((experts, d - shared, up.shape[1]), np.float32)
    downs = np.zeros((experts, down.shape[0], d - shared), np.float32)
    ups[0], downs[0] = up[shared:], down[:, shared:]
    bias = np.zeros(experts, np.float32)
    bias[0] = 1.0
    return up[:shared], down[:, :shared], ups, downs, np.zeros((experts, up.shape[1]), np.float32), bias


def plan(config: dict, tensors: dict, tokenizer: dict | None = None, context_length: int = 4096) -> Plan:
    """The GGUF of ``config`` / ``tensors`` (HF NemotronH names; ``mtp.*`` dropped) with ``tokenizer``
    (a tokenizers JSON, ByteLevel BPE) as llama.cpp's ``gpt2`` vocabulary, or none (ids only)."""
    kinds = _kinds(config)
    n_layer = len(kinds)
    experts = int(config.get("n_routed_experts") or 0)
    if "moe" not in kinds or experts < 2:
        raise ValueError("config.json: llama.cpp's nemotron_h_moe needs a MoE layer with n_routed_experts >= 2")
    shared = int(config["moe_shared_expert_intermediate_size"])
    dense, moe = int(config["intermediate_size"]), int(config["moe_intermediate_size"])
    heads, kv_heads, head_dim = (int(config[k]) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    m_heads, m_head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    groups = int(config.get("n_groups", 1))
    eps = float(config["layer_norm_epsilon"])

    p = Plan()
    p.meta("context_length", context_length, "u32")
    p.meta("embedding_length", int(config["hidden_size"]), "u32")
    p.meta("block_count", n_layer, "u32")
    p.meta("feed_forward_length", [dense if k == "mlp" else moe if k == "moe" else 0 for k in kinds], "ints")
    p.meta("attention.head_count", heads, "u32")
    p.meta("attention.head_count_kv", [kv_heads if k == "attention" else 0 for k in kinds], "ints")
    p.meta("attention.key_length", head_dim, "u32")
    p.meta("attention.value_length", head_dim, "u32")
    p.meta("attention.layer_norm_epsilon", eps, "f32")
    p.meta("attention.layer_norm_rms_epsilon", eps, "f32")
    p.meta("ssm.conv_kernel", int(config["conv_kernel"]), "u32")
    p.meta("ssm.inner_size", m_heads * m_head_dim, "u32")
    p.meta("ssm.state_size", int(config["ssm_state_size"]), "u32")
    p.meta("ssm.time_step_rank", m_heads, "u32")       # llama.cpp's name for the number of SSM heads
    p.meta("ssm.group_count", groups, "u32")
    p.meta("expert_count", experts, "u32")
    p.meta("expert_used_count", [1 if k == "mlp" else int(config["num_experts_per_tok"]) if k == "moe" else 0
                                 for k in kinds], "ints")
    p.meta("expert_feed_forward_length", [dense - shared if k == "mlp" else moe if k == "moe" else 0
                                          for k in kinds], "ints")
    p.meta("expert_shared_feed_forward_length", shared, "u32")
    p.meta("expert_weights_norm", bool(config.get("norm_topk_prob", True)), "bool")
    p.meta("expert_weights_scale", float(config.get("routed_scaling_factor") or 1.0), "f32")
    p.meta("vocab_size", int(config["vocab_size"]), "u32")

    def get(name):
        if name not in tensors:
            raise ValueError(f"checkpoint: tensor {name} missing")
        return np.asarray(tensors[name], np.float32)

    p.tensor("token_embd.weight", get("backbone.embeddings.weight"))
    p.tensor("output_norm.weight", get("backbone.norm_f.weight"), True)
    head = "backbone.embeddings.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    p.tensor("output.weight", get(head))
    for i, kind in enumerate(kinds):
        src, dst = f"backbone.layers.{i}.", f"blk.{i}."
        p.tensor(dst + "attn_norm.weight", get(src + "norm.weight"), True)
        mixer = src + "mixer."
        if kind == "mamba":
            p.tensor(dst + "ssm_in.weight", get(mixer + "in_proj.weight"))
            p.tensor(dst + "ssm_conv1d.weight", get(mixer + "conv1d.weight")[:, 0, :], True)
            p.tensor(dst + "ssm_conv1d.bias", get(mixer + "conv1d.bias"), True)
            p.tensor(dst + "ssm_dt.bias", get(mixer + "dt_bias"), True)
            p.tensor(dst + "ssm_a", -np.exp(get(mixer + "A_log")).reshape(-1, 1), True)
            p.tensor(dst + "ssm_d", get(mixer + "D").reshape(-1, 1), True)
            p.tensor(dst + "ssm_norm.weight", get(mixer + "norm.weight").reshape(groups, -1), True)
            p.tensor(dst + "ssm_out.weight", get(mixer + "out_proj.weight"))
        elif kind == "attention":
            for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                p.tensor(f"{dst}{theirs}.weight", get(f"{mixer}{ours}.weight"))
        else:
            if kind == "mlp":
                sh_up, sh_down, ups, downs, router, bias = dense_as_routed(
                    get(mixer + "up_proj.weight"), get(mixer + "down_proj.weight"), shared, experts)
            else:
                sh_up, sh_down = get(mixer + "shared_experts.up_proj.weight"), get(mixer + "shared_experts.down_proj.weight")
                ups = np.stack([get(f"{mixer}experts.{e}.up_proj.weight") for e in range(experts)])
                downs = np.stack([get(f"{mixer}experts.{e}.down_proj.weight") for e in range(experts)])
                router, bias = get(mixer + "gate.weight"), get(mixer + "gate.e_score_correction_bias")
            p.tensor(dst + "ffn_gate_inp.weight", router, True)
            p.tensor(dst + "exp_probs_b.bias", bias, True)
            p.tensor(dst + "ffn_up_exps.weight", ups)
            p.tensor(dst + "ffn_down_exps.weight", downs)
            p.tensor(dst + "ffn_up_shexp.weight", sh_up)
            p.tensor(dst + "ffn_down_shexp.weight", sh_down)
    if tokenizer is not None:
        _vocabulary(p, tokenizer, int(config["vocab_size"]), config)
    return p


def _vocabulary(p: Plan, tokenizer: dict, vocab_size: int, config: dict) -> None:
    """The tokenizers JSON's BPE as llama.cpp's byte-level ``gpt2`` vocabulary (tokens in id order,
    added tokens as control tokens, merges as ``"a b"``)."""
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json: model.type {model.get('type')!r}, expected BPE")
    tokens = [None] * vocab_size
    for text, i in model["vocab"].items():
        tokens[i] = text
    special = {t["id"] for t in tokenizer.get("added_tokens", [])}
    for t in tokenizer.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
    if any(t is None for t in tokens):
        raise ValueError(f"tokenizer.json: ids below vocab_size {vocab_size} without a token")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    p.meta("tokenizer.ggml.model", "gpt2", "str")
    p.meta("tokenizer.ggml.pre", "gpt-2", "str")
    p.meta("tokenizer.ggml.tokens", tokens, "strs")
    p.meta("tokenizer.ggml.token_type", [3 if i in special else 1 for i in range(vocab_size)], "ints")
    p.meta("tokenizer.ggml.merges", merges, "strs")
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if config.get(key) is not None:
            p.meta(f"tokenizer.ggml.{name}_token_id", int(config[key]), "u32")
    p.meta("tokenizer.ggml.add_bos_token", False, "bool")


def write(p: Plan, path: Path, dtype: str = "f32") -> Path:
    """Writes ``p`` with the ``gguf`` package; big matrices as ``dtype`` (f32, f16, bf16), the rest f32."""
    import gguf
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    for key, value, kind in p.metadata:
        full = key if key.startswith(("tokenizer.", "general.")) else f"{ARCH}.{key}"
        {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool, "str": writer.add_string,
         "ints": writer.add_array, "strs": writer.add_array}[kind](full, value)
    for name, array, keep_f32 in p.tensors:
        if keep_f32 or dtype == "f32" or array.ndim < 2:
            writer.add_tensor(name, array)
        elif dtype == "f16":
            writer.add_tensor(name, array.astype(np.float16))
        elif dtype == "bf16":
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            raise ValueError(f"--dtype: expected f32, f16 or bf16, got {dtype}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def read_checkpoint(directory: Path) -> tuple[dict, dict, dict | None]:
    from safetensors.numpy import load_file
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(shard)).items() if not k.startswith("mtp.")})
    tok = directory / "tokenizer.json"
    return config, tensors, json.loads(tok.read_text()) if tok.is_file() else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32")
    args = ap.parse_args(argv)
    config, tensors, tokenizer = read_checkpoint(Path(args.checkpoint_dir))
    out = write(plan(config, tensors, tokenizer), Path(args.output), args.dtype)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
