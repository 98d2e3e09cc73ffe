"""The llama.cpp peer's GGUF plan (benchmarks/llama_cpp_gguf.py): the FFN layers, evaluated the way
llama.cpp's nemotron_h_moe graph evaluates them (sigmoid router, selection by score + bias, top-k
weights normalised, relu2 experts plus the shared expert), equal transformers' NemotronH modules on
the embedded target, the dense MLP layers written as one-expert MoE layers included; the per-layer
arrays give llama.cpp's layer kinds; the vocabulary is the tokenizer's."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import NemotronHForCausalLM

from builder import embedded
from tolerances import gamma

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("llama_cpp_gguf", ROOT / "benchmarks" / "llama_cpp_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def planned():
    gguf = _module()
    config, tensors, tokenizer = gguf.read_checkpoint(embedded.target_dir())
    return gguf, config, gguf.plan(config, tensors, tokenizer)


def _tensors(p):
    return {name: array for name, array, _ in p.tensors}


def _meta(p):
    return {key: value for key, value, _ in p.metadata}


def llama_cpp_ffn(t: dict, i: int, x: np.ndarray, used: int, norm: bool) -> np.ndarray:
    """llama.cpp's build_ffn_layer with experts (build_moe_ffn, sigmoid gating) on rows ``x``."""
    relu2 = lambda v: np.maximum(v, 0) ** 2                                  # noqa: E731
    b = f"blk.{i}."
    scores = 1 / (1 + np.exp(-(x @ t[b + "ffn_gate_inp.weight"].T)))
    chosen = np.argsort(-(scores + t[b + "exp_probs_b.bias"]), axis=1, kind="stable")[:, :used]
    out = relu2(x @ t[b + "ffn_up_shexp.weight"].T) @ t[b + "ffn_down_shexp.weight"].T
    for r in range(x.shape[0]):
        w = scores[r, chosen[r]]
        w = w / w.sum() if norm else w
        for e, we in zip(chosen[r], w):
            out[r] += we * (t[b + "ffn_down_exps.weight"][e] @ relu2(t[b + "ffn_up_exps.weight"][e] @ x[r]))
    return out


def test_ffn_layers_equal_transformers(planned):
    _, config, p = planned
    t, meta = _tensors(p), _meta(p)
    hf = NemotronHForCausalLM.from_pretrained(str(embedded.target_dir()), dtype=torch.float32).eval()
    x = torch.randn(1, 9, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    kinds = config["layers_block_type"]
    checked = set()
    for i, kind in enumerate(kinds):
        if kind not in ("mlp", "moe"):
            continue
        with torch.no_grad():
            want = hf.model.layers[i].mixer(x).numpy()[0]
        got = llama_cpp_ffn(t, i, x.numpy()[0], meta["expert_used_count"][i], meta["expert_weights_norm"])
        width = config["intermediate_size"] if kind == "mlp" else config["moe_intermediate_size"]
        # both sides float32: each output sums |down| (|up| |x|)^2 terms over every expert at most,
        # each term off by the up product's rounding (twice, squared), the down product's and the mix's
        b, a = f"blk.{i}.", np.abs(x.numpy()[0]).astype(np.float64)
        terms = np.abs(t[b + "ffn_down_shexp.weight"]) @ (np.abs(t[b + "ffn_up_shexp.weight"]) @ a.T) ** 2
        for up, down in zip(t[b + "ffn_up_exps.weight"], t[b + "ffn_down_exps.weight"]):
            terms = terms + np.abs(down) @ (np.abs(up) @ a.T) ** 2
        n = config["hidden_size"]
        bound = 2 * (2 * gamma(n) + gamma(width) + gamma(len(t[b + "exp_probs_b.bias"]) + 1)) * terms.T
        assert (np.abs(got - want) <= bound).all(), f"layer {i} ({kind}): {np.abs(got - want).max()} > bound"
        swapped = dict(t)        # a control the bound must catch: the experts in reverse order
        for name in ("ffn_up_exps.weight", "ffn_down_exps.weight"):
            swapped[b + name] = t[b + name][::-1]
        wrong = llama_cpp_ffn(swapped, i, x.numpy()[0], meta["expert_used_count"][i], meta["expert_weights_norm"])
        assert (np.abs(wrong - want) > bound).any(), f"layer {i}: the bound cannot tell reversed experts"
        checked.add(kind)
    assert checked == {"mlp", "moe"}


def test_dense_layer_routes_to_expert_zero_only(planned):
    gguf, config, _ = planned
    rng = np.random.default_rng(1)
    up, down = rng.standard_normal((12, 5), np.float32), rng.standard_normal((5, 12), np.float32)
    sh_up, sh_down, ups, downs, router, bias = gguf.dense_as_routed(up, down, 4, 3)
    assert ups.shape == (3, 8, 5) and downs.shape == (3, 5, 8) and not ups[1:].any() and not downs[1:].any()
    assert not router.any() and bias.argmax() == 0 and (bias[1:] == 0).all()
    with pytest.raises(ValueError, match="cannot split"):
        gguf.dense_as_routed(up, down, 12, 3)


def test_layer_kinds_follow_llama_cpp_rule(planned):
    _, config, p = planned
    meta = _meta(p)
    ff, kv = meta["feed_forward_length"], meta["attention.head_count_kv"]
    kinds = ["mamba" if f == 0 and k == 0 else "attention" if f == 0 else "ffn" for f, k in zip(ff, kv)]
    want = [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, "ffn") for k in config["layers_block_type"]]
    assert kinds == want
    t = _tensors(p)
    for i, kind in enumerate(kinds):     # an FFN layer's expert width is the per-layer array's
        if kind == "ffn":
            assert t[f"blk.{i}.ffn_up_exps.weight"].shape[1] == meta["expert_feed_forward_length"][i]
        if kind == "mamba":
            assert t[f"blk.{i}.ssm_a"].shape == (config["mamba_num_heads"], 1)
            assert (t[f"blk.{i}.ssm_a"] < 0).all()
    assert not any(name.startswith("mtp") for name in t)


def test_vocabulary_is_the_tokenizers(planned):
    _, config, p = planned
    meta = _meta(p)
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == config["vocab_size"] == len(set(tokens))
    assert all(tok.id_to_token(i) == tokens[i] for i in range(len(tokens)))
    assert meta["tokenizer.ggml.merges"] and all(len(m.split(" ")) == 2 for m in meta["tokenizer.ggml.merges"])


def test_bad_config_is_one_line(planned):
    gguf, config, _ = planned
    bad = dict(config, layers_block_type=["linear_attention", "conv"])
    with pytest.raises(ValueError, match="layers_block_type holds 'conv'"):
        gguf.plan(bad, {})
