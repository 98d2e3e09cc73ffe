"""Nemotron 3.5 Lightning drafts (DFlash with yarn RoPE; DSpark with causal sliding-window attention,
sinks and a Markov head) read from their own keys: the transformers oracle, the TensorRT lowering,
exact speculation on the embedded target, and bad configs.

Checkpoints are written by tests/nemotron35_fixtures.py (our code, the published key layout, scaled
down). The oracle is assembled from transformers' Qwen3 modules (``Qwen3RMSNorm``, ``Qwen3MLP``,
``Qwen3RotaryEmbedding`` with yarn, ``apply_rotary_pos_emb``), its mask functions
(``sliding_window_overlay``: Hugging Face's inclusive window) and attention cores (Qwen3's eager
attention; GPT-OSS's for sinks).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from builder.draft_checkpoint_block import load_block_draft_checkpoint, load_block_draft_config, validate_block_draft
from builder.interpreter import run_network
from builder.models.dflash import DFlashDraft
from builder.models.dspark import DSparkDraft
from draft_helpers import draft_error, dynamic_profile, record_block_draft
from nemotron35_fixtures import draft_config, draft_weights, write
from tolerances import assert_within, lm_head_bound, logit_order_bound

H, V = 32, 96
TARGET = SimpleNamespace(hidden_size=H, vocab_size=V, num_layers=6)
LAYERS = [0, 2, 4]            # target layer outputs (hidden_states ids 1, 3, 5)
CONTEXT, CAPACITY = 10, 24
KINDS = ["dflash", "dspark"]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron35")
    out = {}
    for kind in KINDS:
        config = draft_config(kind, H, V, LAYERS)
        weights = draft_weights(config, H, seed=KINDS.index(kind))
        out[kind] = SimpleNamespace(config=config, weights=weights, root=root,
                                    plain=write(root / f"{kind}_fp32", config, weights, dtype=torch.float32),
                                    nvfp4=write(root / f"{kind}_nvfp4", config, weights, quantize=True))
    g = torch.Generator().manual_seed(9)
    return SimpleNamespace(**out, lm_head=torch.randn(V, H, generator=g) / H ** 0.5)


def _module(directory, lm_head, dtype=torch.float32):
    cfg, weights = load_block_draft_checkpoint(directory)
    cfg = validate_block_draft(cfg, TARGET)
    return (DSparkDraft if cfg.kind == "dspark" else DFlashDraft)(cfg, weights, None, lm_head, dtype)


# --- reading ---------------------------------------------------------------------------------------------
def test_configs_come_from_their_own_keys(drafts):
    flash = load_block_draft_config(drafts.dflash.nvfp4)
    assert (flash.kind, flash.source, flash.target_layer_ids, flash.sample_from_anchor) == ("dflash", "nemotron35",
                                                                                         (1, 3, 5), False)
    assert flash.rope_scaling_dict == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    assert not (flash.causal or flash.sliding_window or flash.attention_sinks) and flash.embedding_rows == V
    spark = load_block_draft_config(drafts.dspark.nvfp4)
    assert (spark.causal, spark.sliding_window, spark.attention_sinks, spark.block_size) == (True, 6, True, 8)
    assert (spark.markov_rank, spark.markov_head_type, spark.rope_scaling, spark.sample_from_anchor) == (
        16, "vanilla", None, False)
    assert spark.num_attention_heads * spark.head_dim != spark.hidden_size and spark.num_key_value_heads == 2
    _, weights = load_block_draft_checkpoint(drafts.dspark.nvfp4)
    packed = {n for n, w in weights.items() if getattr(w, "is_nvfp4", False)}
    assert {"fc.weight", "layers.1.mlp.down_proj.weight", "markov_head.markov_w2.weight"} <= packed
    assert not any("self_attn" in n or "markov_w1" in n or "embed" in n for n in packed)  # exclude_modules wildcards
    assert weights["layers.0.self_attn.attention_sink_bias"].dtype == torch.float32


@pytest.mark.parametrize("keep", ["quantization_config", "hf_quant_config.json"])
def test_nvfp4_from_either_quantization_config(drafts, tmp_path, keep):
    import shutil
    path = Path(shutil.copytree(drafts.dflash.nvfp4, tmp_path / keep))
    if keep == "quantization_config":
        (path / "hf_quant_config.json").unlink()
    else:
        config = json.loads((path / "config.json").read_text())
        del config["quantization_config"]
        (path / "config.json").write_text(json.dumps(config))
    _, weights = load_block_draft_checkpoint(path)
    assert getattr(weights["layers.0.mlp.up_proj.weight"], "is_nvfp4", False)
    assert not getattr(weights["layers.0.self_attn.q_proj.weight"], "is_nvfp4", False)


# --- the transformers oracle ----------------------------------------------------------------------------
class Reference:
    """The draft's block forward from transformers' Qwen3 pieces: context K/V from hidden_norm(fc(aux)),
    then the block rows through each layer, attending to [context, block] under the draft's mask."""

    def __init__(self, config, weights, lm_head, dtype):
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding
        rope = config["rope_parameters"] or {"rope_type": "default", "rope_theta": config["rope_theta"]}
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings")
        self.qc = Qwen3Config(**{k: config[k] for k in keys}, rope_parameters=dict(rope))
        self.config, self.dtype = config, dtype
        self.w = {n: t.to(dtype) for n, t in weights.items() if "attention_sink_bias" not in n}
        self.sinks = {n: t.float() for n, t in weights.items() if "attention_sink_bias" in n}
        self.lm_head = lm_head.to(dtype)
        self.rotary = Qwen3RotaryEmbedding(self.qc).to(dtype)

        def norm(name, size):
            m = Qwen3RMSNorm(size, eps=self.qc.rms_norm_eps)
            m.weight.data.copy_(self.w[name])
            return m.to(dtype)
        self.norm = norm
        self.mlps = []
        for i in range(self.qc.num_hidden_layers):
            mlp = Qwen3MLP(self.qc)
            mlp.load_state_dict({n: self.w[f"layers.{i}.mlp.{n}"] for n in mlp.state_dict()})
            self.mlps.append(mlp.to(dtype))

    def _mask(self, q_pos, k_pos, k_ctx):
        from transformers.masking_utils import sliding_window_overlay
        d = self.config["dflash_config"]
        window = d.get("swa_window_size") if d["use_swa"] else None
        ok = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
        for i, qp in enumerate(q_pos.tolist()):
            for j, (kp, ctx) in enumerate(zip(k_pos.tolist(), k_ctx.tolist())):
                visible = ctx or not d["causal"] or kp <= qp
                if window is not None:
                    visible = visible and sliding_window_overlay(window)(0, 0, qp, kp)
                ok[i, j] = visible
        return torch.zeros(ok.shape, dtype=self.dtype).masked_fill(~ok, float("-inf"))[None, None]

    @torch.no_grad()
    def __call__(self, aux, block_ids, anchor):
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as sink_attention
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, eager_attention_forward
        c, w, qc = self.config, self.w, self.qc
        heads, kv, D = qc.num_attention_heads, qc.num_key_value_heads, qc.head_dim
        ctx = self.norm("hidden_norm.weight", qc.hidden_size)(aux.to(self.dtype) @ w["fc.weight"].t())[None]
        x = w["embed_tokens.weight"][block_ids][None]
        tc, rows = ctx.shape[1], x.shape[1]
        pos_c, pos_b = torch.arange(tc), anchor + torch.arange(rows)
        mask = self._mask(pos_b, torch.cat([pos_c, pos_b]), torch.cat([torch.ones(tc), torch.zeros(rows)]).bool())
        cos_c, sin_c = self.rotary(ctx, pos_c[None])
        cos_b, sin_b = self.rotary(x, pos_b[None])
        for i in range(qc.num_hidden_layers):
            p = f"layers.{i}."
            h = self.norm(p + "input_layernorm.weight", qc.hidden_size)(x)
            qn, kn = self.norm(p + "self_attn.q_norm.weight", D), self.norm(p + "self_attn.k_norm.weight", D)

            def proj(t, name, n):
                return (t @ w[p + f"self_attn.{name}_proj.weight"].t()).view(1, t.shape[1], n, D).transpose(1, 2)
            q = qn(proj(h, "q", heads).transpose(1, 2)).transpose(1, 2)
            kb, kc = (kn(proj(t, "k", kv).transpose(1, 2)).transpose(1, 2) for t in (h, ctx))
            q, kb = apply_rotary_pos_emb(q, kb, cos_b, sin_b)
            kc, _ = apply_rotary_pos_emb(kc, kc, cos_c, sin_c)
            k, v = torch.cat([kc, kb], 2), torch.cat([proj(ctx, "v", kv), proj(h, "v", kv)], 2)
            sinks = self.sinks.get(p + "self_attn.attention_sink_bias")
            module = SimpleNamespace(num_key_value_groups=heads // kv, training=False, sinks=sinks)
            attend = eager_attention_forward if sinks is None else sink_attention
            y, _ = attend(module, q, k, v, mask, scaling=D ** -0.5)
            x = x + y.reshape(1, rows, heads * D) @ w[p + "self_attn.o_proj.weight"].t()
            x = x + self.mlps[i](self.norm(p + "post_attention_layernorm.weight", qc.hidden_size)(x))
        return self.norm("norm.weight", qc.hidden_size)(x)[0] @ self.lm_head.t()


def _ours(module, aux, block_ids, anchor):
    state = {n: torch.zeros(s, dtype=d) for n, (s, d) in module.state_spec(1, CAPACITY).items()}
    tc, rows = aux.shape[0], len(block_ids)
    i32 = torch.int32
    logits, _ = module.forward(aux[None].to(module.dtype), torch.arange(tc, dtype=i32)[None], torch.tensor([tc], dtype=i32),
                               block_ids[None].to(i32), (anchor + torch.arange(rows, dtype=i32))[None],
                               torch.tensor([rows], dtype=i32), torch.arange(rows, dtype=i32)[None], state)
    return logits[0]


@pytest.mark.parametrize("kind", KINDS)
def test_block_logits_match_transformers(drafts, kind):
    d = getattr(drafts, kind)
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(CONTEXT, len(LAYERS) * H, generator=g)
    rows = 8                                                   # anchor + 7 mask rows: the bonus-anchor block
    block_ids = torch.full((rows,), d.config["mask_token_id"])
    block_ids[0] = 17
    out = {}
    for dtype in (torch.float32, torch.float64):
        ref = Reference(d.config, d.weights, drafts.lm_head, dtype)
        out[dtype] = (ref(aux, block_ids, CONTEXT), _ours(_module(d.plain, drafts.lm_head, dtype), aux, block_ids, CONTEXT))
    (theirs, ours), (theirs64, ours64) = out[torch.float32], out[torch.float64]
    # each side's fp32 rounding measured against its float64 evaluation (both build RoPE tables in fp32)
    spread = float((ours - ours64).abs().max() + (theirs - theirs64).abs().max())
    bound = logit_order_bound(lm_head_bound(d.weights["norm.weight"], drafts.lm_head), spread)
    assert_within(ours, theirs, bound, f"{kind} block logits")
    if kind == "dspark":  # the Markov head on top: W2 @ W1[previous token]
        module = _module(d.plain, drafts.lm_head)
        prev = torch.tensor([[17, 5, 9]])
        got = module.markov_logits(ours[None, 1:4], prev)
        want = theirs[None, 1:4] + d.weights["markov_head.markov_w1.weight"][prev] @ d.weights[
            "markov_head.markov_w2.weight"].t()
        assert_within(got, want, bound + 1e-5 * want.abs().max(), "markov logits")


def test_mask_pieces_matter(drafts):
    """Each of causal, window and sinks changes the DSpark block (none is silently ignored)."""
    import dataclasses
    cfg, weights = load_block_draft_checkpoint(drafts.dspark.plain)
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(CONTEXT, len(LAYERS) * H, generator=g)
    ids = torch.tensor([17] + [3] * 7)
    base = _ours(DSparkDraft(cfg, weights, None, drafts.lm_head), aux, ids, CONTEXT)
    for change in ({"causal": False}, {"sliding_window": None}, {"attention_sinks": False}):
        other = DSparkDraft(dataclasses.replace(cfg, **change), weights, None, drafts.lm_head)
        assert (_ours(other, aux, ids, CONTEXT) - base).abs().max() > 1e-3, change


# --- TensorRT lowering ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_recorded_network_matches_eager(drafts, kind):
    """The NVFP4 draft's network (yarn or window + sinks + causal block, FP4 linears, the FP4 Markov
    head) evaluated by the CPU interpreter against the eager forward."""
    module = _module(getattr(drafts, kind).nvfp4, drafts.lm_head)
    rec = record_block_draft(module)
    assert {"rope", "attention"} <= set(rec.lowerings)
    g = torch.Generator().manual_seed(7)
    i32 = torch.int32
    clen = torch.tensor([4, 2], dtype=i32)
    cpos = torch.tensor([[6], [0]], dtype=i32) + torch.arange(4, dtype=i32)
    ids = torch.tensor([[11] + [3] * 7, [12] + [3] * 7], dtype=i32)
    pos = (cpos[torch.arange(2), (clen - 1).long()] + 1)[:, None] + torch.arange(8, dtype=i32)
    feeds = {"aux": torch.randn(2, 4, module.aux_width, generator=g), "context_positions": cpos, "context_lengths": clen,
             "input_ids": ids, "positions": pos, "lengths": torch.full((2,), 8, dtype=i32),
             "logit_index": torch.arange(1, 8, dtype=i32).repeat(2, 1)}
    if kind == "dspark":
        feeds["prev_ids"] = torch.randint(0, V, (2, 7), generator=g, dtype=i32)
    state = {n: torch.randn(s, generator=g) * 0.5 for n, (s, _) in module.state_spec(2, CAPACITY).items()}
    got = run_network(rec.network, {**feeds, **{"past." + n: v for n, v in state.items()}})
    args = [feeds[k] for k in ("aux", "context_positions", "context_lengths", "input_ids", "positions", "lengths",
                               "logit_index")]
    want, _ = module.forward(*args, {n: v.clone() for n, v in state.items()})
    wide = _module(getattr(drafts, kind).nvfp4, drafts.lm_head, torch.float64)
    exact, _ = wide.forward(args[0].double(), *args[1:], {n: v.double() for n, v in state.items()})
    norm = getattr(drafts, kind).weights["norm.weight"]
    bound = logit_order_bound(lm_head_bound(norm, drafts.lm_head), float((want - exact).abs().max()))
    assert_within(got["logits"], want, bound, f"{kind} interpreted logits")
    if kind == "dspark":
        markov = module.markov_logits(want, feeds["prev_ids"])
        assert_within(got["markov_logits"], markov, bound + (markov - want).abs().max() * 1e-5, "markov logits")


# --- speculation on the embedded target -------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_target(tmp_path_factory):
    from tokenizers import Tokenizer

    from builder import embedded
    from builder.checkpoint import load_checkpoint
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    tcfg, _ = load_checkpoint(embedded.target_dir())
    root = tmp_path_factory.mktemp("nemotron35_on_target")
    layers = [0, tcfg.num_layers // 2 - 1, tcfg.num_layers - 2]
    dirs = {}
    for kind in KINDS:
        config = draft_config(kind, tcfg.hidden_size, tcfg.vocab_size, layers, mask=5, window=8, rank=32,
                              head_dim=64, layers=1)
        dirs[kind] = write(root / kind, config, draft_weights(config, tcfg.hidden_size, seed=3), quantize=True)
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in ("def main(argv=None):\n    ", "class Error(Exception):\n")]
    reference = generate(open_checkpoint(embedded.target_dir()).runner, prompts, 16).output_ids
    return SimpleNamespace(dirs=dirs, prompts=prompts, reference=reference, target=embedded.target_dir())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 7])
def test_speculation_is_exact_at_k1_and_kmax(on_target, kind, k):
    """K = 7 is the most the bonus-anchor block of 8 proposes (the anchor row is the committed token)."""
    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate
    loaded = open_checkpoint(on_target.target, mode=kind, draft_dir=on_target.dirs[kind], max_draft_len=k)
    got = speculative_generate(loaded.runner, loaded.proposer(), on_target.prompts, 16, k)
    assert got.output_ids == on_target.reference
    assert got.extra["acceptance"]["steps_by_draft_len"].get(str(k), 0) > 0


# --- bad configs ----------------------------------------------------------------------------------------
def _edited(drafts, kind, name, edit=None, tensors=None):
    d = getattr(drafts, kind)
    config = json.loads(json.dumps(d.config))
    if edit:
        edit(config)
    path = write(d.root / name, config, d.weights, quantize=True)
    if tensors:
        from safetensors.torch import load_file, save_file
        stored = load_file(str(path / "model.safetensors"))
        tensors(stored)
        save_file(stored, str(path / "model.safetensors"))
    return path


def _set(**changes):
    def edit(config):
        for key, value in changes.items():
            node = config
            *parents, leaf = key.split("__")
            for p in parents:
                node = node[p]
            node[leaf] = value
    return edit


@pytest.mark.parametrize("kind, changes, message", [
    ("dflash", {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "dflash_config__eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
     "field 'eagle_aux_hidden_state_layer_ids' [1, 3, 6] is not target_layer_ids [0, 2, 4] + 1"),
    ("dflash", {"dflash_config__target_layer_ids": [0, 2, 3]},
     "field 'target_layer_ids' is [0, 2, 4] but dflash_config.target_layer_ids is [0, 2, 3]"),
    ("dspark", {"sample_from_anchor": True, "dflash_config__sample_from_anchor": True},
     "field 'dspark_bonus_anchor' is true but sample_from_anchor is true"),
    ("dspark", {"markov_head_type": "lstm"}, "field 'markov_head_type' is 'lstm': unknown Markov head type"),
    ("dspark", {"markov_head_type": "gated"}, "field 'markov_head_type' is 'gated': only the vanilla"),
    ("dspark", {"dspark_markov_rank": 8}, "field 'dspark_markov_rank' is 8 but markov_rank is 16"),
    ("dspark", {"dflash_config__swa_window_size": None, "sliding_window": None},
     "'dflash_config.use_swa' is true but neither"),
    ("dspark", {"layer_types": ["sliding_attention", "full_attention"]}, "field 'layer_types' has 'full_attention'"),
    ("dflash", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
     "'rope_parameters.rope_type' is 'longrope'"),
])
def test_bad_configs_exit_2_naming_the_key(drafts, kind, changes, message):
    path = _edited(drafts, kind, "bad_" + "_".join(changes), _set(**changes))
    assert message in draft_error(load_block_draft_checkpoint, path)


def test_packed_shape_mismatch_names_the_tensor(drafts):
    def shrink(stored):
        name = "model.layers.0.mlp.up_proj.weight"
        stored[name] = stored[name][:, :-8].contiguous()
    path = _edited(drafts, "dflash", "bad_packed", tensors=shrink)
    msg = draft_error(load_block_draft_checkpoint, path)
    assert "packed FP4 tensor 'model.layers.0.mlp.up_proj.weight' has shape [64, 8], expected [64, 16] for logical " \
           "shape [64, 32]" in msg


def test_aux_ids_outside_the_target_name_both_numberings(drafts):
    cfg = load_block_draft_config(drafts.dflash.plain)
    msg = draft_error(validate_block_draft, cfg, SimpleNamespace(hidden_size=H, vocab_size=V, num_layers=4))
    assert "target_layer_ids [0, 2, 4] (HF hidden_states ids [1, 3, 5]) has id 4 outside" in msg


def test_recorded_dspark_network_builds(drafts):
    """TensorRT builds the NVFP4 DSpark network (causal block, sliding window, sinks, FP4 linears and the
    FP4 Markov head) with dynamic batch, context rows, block rows and cache length."""
    from builder.backends.trt_build import build_engine_bytes
    rec = record_block_draft(_module(drafts.dspark.nvfp4, drafts.lm_head))
    assert len(build_engine_bytes(rec, [dynamic_profile(rec)])) > 1000
