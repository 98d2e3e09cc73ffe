"""DFlash, DSpark and P-EAGLE drafts: parity with speculators, TensorRT lowering, validation.

The fixtures in tests/fixtures/speculators were written by scripts/make_block_draft_fixtures.py
(run in a separate venv with speculators 0.9.0): tiny bf16 checkpoints and the reference forward's
fp32 outputs. This file needs no speculators: it loads each fixture with
``builder.draft_checkpoint_block`` and runs our drafts eagerly and through the recorded network.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder.backends.trt_backend import NetworkRecorder
from builder.draft_checkpoint_block import (DFlashConfig, DSparkConfig, PEagleConfig, block_draft_config_from_dict,
                                            is_block_draft, load_block_draft_checkpoint, load_block_draft_config,
                                            validate_block_draft)
from builder.interpreter import run_network
from builder.models.dflash import DFlashDraft
from builder.models.dspark import DSparkDraft
from builder.models.peagle import PEagleDraft
from draft_helpers import draft_error, dynamic_profile, record_block_draft
from tolerances import assert_no_near_tie, assert_within, sum_bound

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
BLOCK = ["dflash_speculators", "dspark_speculators", "dspark_zlab"]
TARGET = SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=6)  # tests/tiny_models.py MOE
REF = dict(rtol=1e-4, atol=1e-4)
CAPACITY = 16
I32 = torch.int32


def markov_bound(module, logits, prev):
    """Two fp32 orders of logits + W2 @ W1[prev] (rank + 1 terms per logit) differ by at most this."""
    rows = module.markov_w1.double()[torch.as_tensor(prev).long()]
    return sum_bound(logits.double().abs() + rows.abs() @ module.markov_w2.double().abs().t(), module.markov_w2.shape[-1] + 1)


def _load(name, dtype=torch.float32):
    cfg, weights = load_block_draft_checkpoint(FIXTURES / name)
    cfg = validate_block_draft(cfg, TARGET)
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    emb, head = ref.get("target_embedding"), ref.get("target_lm_head")
    emb = None if emb is None else emb.float()
    if cfg.kind == "peagle":
        return PEagleDraft(cfg, weights, emb, dtype), ref
    cls = DSparkDraft if cfg.kind == "dspark" else DFlashDraft
    return cls(cfg, weights, emb, None if head is None else head.float(), dtype), ref


def _state(module, batch, scale=0.0, seed=0, capacity=CAPACITY):
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * scale).to(d) for n, (s, d) in module.state_spec(batch, capacity).items()}


def _context(ref, ends, starts=None):
    """Right-padded context chunk of rows starts[b] .. ends[b]-1 (aux, positions, lengths)."""
    starts = starts or [0] * len(ends)
    width = max(1, max(e - s for s, e in zip(starts, ends)))
    aux = torch.zeros(len(ends), width, ref["aux"].shape[-1])
    for b, (s, e) in enumerate(zip(starts, ends)):
        aux[b, :e - s] = ref["aux"][b, s:e]
    positions = torch.tensor(starts, dtype=I32)[:, None] + torch.arange(width, dtype=I32)
    return aux, positions, torch.tensor([e - s for s, e in zip(starts, ends)], dtype=I32)


def _block(module, ref, anchors):
    """Block inputs of the full training block (all block_size rows returned)."""
    ids = ref["input_ids"][torch.arange(len(anchors)), torch.tensor(anchors)]
    block_ids, positions, lengths, _ = module.block_inputs(ids, torch.tensor(anchors), module.block_size - module.first_draft_row)
    index = torch.arange(module.block_size, dtype=I32).repeat(len(anchors), 1)
    return block_ids, positions, lengths, index


# --- checkpoints ---------------------------------------------------------------------------------------
def test_fixture_configs():
    dflash = load_block_draft_config(FIXTURES / "dflash_speculators")
    assert isinstance(dflash, DFlashConfig) and not isinstance(dflash, DSparkConfig)
    assert (dflash.target_layer_ids, dflash.block_size, dflash.mask_token_id) == ((1, 3, 5), 4, 95)
    assert not dflash.sample_from_anchor and not dflash.has_lm_head and not dflash.embedding_rows
    assert dflash.num_speculative_tokens == 3 and dflash.num_hidden_layers == 2
    dspark = load_block_draft_config(FIXTURES / "dspark_speculators")
    assert isinstance(dspark, DSparkConfig) and dspark.sample_from_anchor and dspark.markov_rank == 8
    assert dspark.has_d2t and dspark.has_lm_head and dspark.draft_vocab_size == 64 and dspark.confidence_head
    assert dspark.target_layer_ids == (0, 2, 6) and dspark.rope_scaling_dict["rope_type"] == "llama3"
    zlab = load_block_draft_config(FIXTURES / "dspark_zlab")
    assert zlab.source == "zlab" and zlab.architecture == "Qwen3DSparkModel"
    assert zlab.target_layer_ids == (2, 4, 5)  # dflash_config.target_layer_ids [1, 3, 4] are layer outputs
    assert not zlab.sample_from_anchor and zlab.markov_rank == 4 and zlab.embedding_rows == 96 and zlab.has_lm_head
    peagle = load_block_draft_config(FIXTURES / "peagle_speculators")
    assert isinstance(peagle, PEagleConfig) and peagle.mask_token_id == 93 and peagle.num_speculative_tokens == 3
    assert peagle.aux_layer_ids == (1, 3, 4) and peagle.has_embedding and peagle.has_d2t
    for c in (dflash, dspark, zlab, peagle):
        assert block_draft_config_from_dict(json.loads(json.dumps(c.to_dict()))) == c
        assert is_block_draft(FIXTURES / ("dflash_speculators" if c is dflash else "peagle_speculators"))
    assert not is_block_draft(FIXTURES / "eagle3_llama3")


def test_fused_projections_are_split():
    _, w = load_block_draft_checkpoint(FIXTURES / "dspark_zlab")
    assert w["layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    assert w["layers.0.self_attn.k_proj.weight"].shape == w["layers.0.self_attn.v_proj.weight"].shape == (16, 32)
    assert w["layers.0.mlp.gate_proj.weight"].shape == w["layers.0.mlp.up_proj.weight"].shape == (48, 32)
    assert "embed_tokens.weight" in w and not any(n.startswith("model.") for n in w)


# --- parity with the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK)
def test_block_matches_reference(name):
    """B=2 ragged: context rows 0..a_b-1 of both sequences and their blocks at a_b, one forward."""
    module, ref = _load(name)
    for k in range(ref["anchors"].shape[1]):
        anchors = ref["anchors"][:, k].tolist()
        aux, cpos, clen = _context(ref, anchors)
        ids, pos, lens, index = _block(module, ref, anchors)
        logits, state = module.forward(aux, cpos, clen, ids, pos, lens, index, _state(module, 2))
        assert logits.dtype == torch.float32 and logits.shape == ref["block_logits"][:, k].shape
        torch.testing.assert_close(logits, ref["block_logits"][:, k], **REF, msg=f"anchors {anchors}")
        if module.kind == "dspark":
            got = module.markov_logits(logits, ref["prev_ids"][:, k])
            torch.testing.assert_close(got, ref["markov_logits"][:, k], **REF)


def test_context_accumulates_and_stale_block_rows_are_harmless():
    """Context appended in two chunks across a block at an earlier anchor (whose rows are then
    overwritten / masked) gives the reference block at the later anchor: no rollback needed."""
    module, ref = _load("dflash_speculators")
    late, early = ref["anchors"][:, 0].tolist(), ref["anchors"][:, 1].tolist()  # [4, 2], [2, 1]
    state = _state(module, 2, scale=1.0, seed=3)  # garbage everywhere: all read slots get written
    aux, cpos, clen = _context(ref, early)
    _, state = module.forward(aux, cpos, clen, *_block(module, ref, early), state)
    state = {**state, **module.append_context(*_context(ref, late, early), state)}
    logits, _ = module.block(*_block(module, ref, late), state)
    torch.testing.assert_close(logits, ref["block_logits"][:, 0], **REF)


def test_block_inputs_follow_sample_from_anchor():
    dflash, _ = _load("dflash_speculators")  # anchor row dropped: K+1 rows, logits of rows 1..K
    ids, pos, lens, index = dflash.block_inputs(torch.tensor([7, 8]), torch.tensor([10, 3]), 3)
    assert ids.tolist() == [[7, 95, 95, 95], [8, 95, 95, 95]] and pos[1].tolist() == [3, 4, 5, 6]
    assert lens.tolist() == [4, 4] and index.tolist() == [[1, 2, 3]] * 2
    dspark, _ = _load("dspark_speculators")  # sample from the anchor: K rows, logits of rows 0..K-1
    ids, pos, lens, index = dspark.block_inputs(torch.tensor([7]), torch.tensor([10]), 3)
    assert ids.tolist() == [[7, 90, 90]] and index.tolist() == [[0, 1, 2]] and dspark.block_rows(3) == 3


def test_dspark_chooses_left_to_right_with_target_ids():
    """Greedy block choice: draft j's logits = its row + W2 @ W1[previous token as a TARGET id]."""
    module, ref = _load("dspark_speculators")
    anchors = ref["anchors"][:, 0].tolist()
    aux, cpos, clen = _context(ref, anchors)
    ids, pos, lens, index = module.block_inputs(ref["input_ids"][[0, 1], anchors], torch.tensor(anchors), 4)
    base, _ = module.forward(aux, cpos, clen, ids, pos, lens, index, _state(module, 2))
    tokens, used = module.choose_block(base, ids[:, 0], lambda row: row.argmax(-1))
    prev = ids[:, 0].long()
    for j in range(4):
        want = base[:, j] + module.markov_w2.float()[None].matmul(module.markov_w1.float()[prev][..., None])[..., 0]
        bound = markov_bound(module, base[:, j], prev)
        assert_within(used[:, j], want, bound, f"draft {j}")
        assert torch.equal(tokens[:, j], used[:, j].argmax(-1))  # chosen from exactly these logits
        assert_no_near_tie(want, tokens[:, j], bound, f"draft {j}")  # and no rounding-level tie decided it
        prev = tokens[:, j] + module.d2t[tokens[:, j]]


def test_peagle_matches_reference():
    """Depth-0 rows (B=2 ragged), then per anchor one forward: catch-up rows 0..a + K-1 placeholders."""
    module, ref = _load("peagle_speculators")
    lengths = ref["lengths"]
    batch, rows = ref["input_ids"].shape
    index = torch.arange(rows, dtype=I32).repeat(batch, 1)
    logits, _ = module.forward(ref["input_ids"], ref["aux"], torch.zeros(batch, rows, dtype=I32), ref["positions"],
                               lengths, index, _state(module, batch))
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(logits[b, :n], ref["logits"][b, :n], **REF)
    K = module.num_speculative_tokens
    for k in range(ref["anchors"].shape[1]):
        a = ref["anchors"][:, k].tolist()
        feeds = module.step_inputs([ref["input_ids"][b, :a[b] + 1].tolist() for b in range(batch)],
                                   [ref["aux"][b, :a[b] + 1] for b in range(batch)], [0, 0], K)
        logits, _ = module.forward(*feeds, _state(module, batch, scale=1.0, seed=k))
        torch.testing.assert_close(logits[:, 0], ref["logits"][[0, 1], a], **REF)
        torch.testing.assert_close(logits[:, 1:], ref["parallel_logits"][:, k], **REF)


def test_bf16_block_close_to_reference():
    module, ref = _load("dflash_speculators", torch.bfloat16)
    anchors = ref["anchors"][:, 0].tolist()
    aux, cpos, clen = _context(ref, anchors)
    logits, _ = module.forward(aux.bfloat16(), cpos, clen, *_block(module, ref, anchors), _state(module, 2))
    want = ref["block_logits"][:, 0]
    assert logits.dtype == torch.float32 and (logits - want).abs().max() < 0.05 * want.abs().max()


def _nvfp4_dspark(tmp_path):
    """The dspark_speculators fixture with a rank-16 Markov head, written as a ModelOpt NVFP4 W4A16
    checkpoint: Markov W2 and two backbone projections packed (W1, embeddings, norms stay bf16)."""
    from builder.quantization import HF_QUANT_CONFIG, QUANT_ALGO, quantize_tensors
    path = _copy(tmp_path, "dspark_speculators")
    _edit_config(path, markov_rank=16)
    t = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    t["markov_head.markov_w1.weight"] = torch.randn(96, 16, generator=g).bfloat16()
    t["markov_head.markov_w2.weight"] = (torch.randn(64, 16, generator=g) * 0.5).bfloat16()
    t["confidence_head.proj.weight"] = torch.randn(1, 48, generator=g).bfloat16()
    names = ["markov_head.markov_w2.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"]
    t = quantize_tensors({k: (v.float() if k in names else v) for k, v in t.items()}, names)
    save_file(t, str(path / "model.safetensors"))
    (path / HF_QUANT_CONFIG).write_text(json.dumps({"producer": {"name": "test"}, "quantization": {
        "quant_algo": QUANT_ALGO, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": []}}))
    return path


def test_nvfp4_dspark_uses_the_fused_markov_head(tmp_path):
    """Packed weights load as NVFP4Weight; the backbone runs them through F.linear's NVFP4 path and
    the Markov step through F.fp4_markov_head, matching the dequantized draft run with plain ops."""
    from builder.nvfp4_format import NVFP4Weight
    path = _nvfp4_dspark(tmp_path)
    ref = load_file(str(FIXTURES / "dspark_speculators" / "reference.safetensors"))
    emb = ref["target_embedding"].float()
    cfg, w = load_block_draft_checkpoint(path)
    cfg = validate_block_draft(cfg, TARGET)
    assert isinstance(w["markov_head.markov_w2.weight"], NVFP4Weight) and cfg.markov_rank == 16
    assert isinstance(w["layers.0.self_attn.q_proj.weight"], NVFP4Weight)
    quant = DSparkDraft(cfg, w, emb)
    plain = DSparkDraft(cfg, load_block_draft_checkpoint(path, keep_quantized=False)[1], emb)
    assert quant.markov_w2_fp4 and not plain.markov_w2_fp4
    anchors = ref["anchors"][:, 0].tolist()
    aux, cpos, clen = _context(ref, anchors)
    block = _block(quant, ref, anchors)
    got, _ = quant.forward(aux, cpos, clen, *block, _state(quant, 2))
    want, _ = plain.forward(aux, cpos, clen, *block, _state(plain, 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    prev = ref["prev_ids"][:, 0]
    # the fused FP4 Markov op (matmul) against gather + linear + add on the dequantized W2: two orders
    assert_within(quant.markov_logits(got, prev), plain.markov_logits(want, prev), markov_bound(plain, want, prev))
    rec = _record_block(quant)
    assert "fp4_markov_head" in rec.lowerings
    feeds = {"aux": aux, "context_positions": cpos, "context_lengths": clen, "input_ids": block[0],
             "positions": block[1], "lengths": block[2], "logit_index": block[3], "prev_ids": prev}
    out = run_network(rec.network, {**feeds, **{"past." + n: v for n, v in _state(quant, 2).items()}})
    torch.testing.assert_close(out["markov_logits"], quant.markov_logits(got, prev), **REF)


def test_error_nvfp4_tensors(tmp_path):
    path = _nvfp4_dspark(tmp_path)
    t = load_file(str(path / "model.safetensors"))
    save_file({**t, "markov_head.markov_w2.weight": t["markov_head.markov_w2.weight"][:, :7].contiguous()},
              str(path / "model.safetensors"))
    assert "packed FP4 tensor 'markov_head.markov_w2.weight' has shape [64, 7], expected [64, 8]" in _error(
        load_block_draft_checkpoint, path)
    save_file({k: v for k, v in t.items() if k != "layers.0.self_attn.q_proj.weight_scale_2"},
              str(path / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight_scale_2" in _error(load_block_draft_checkpoint, path)
    save_file({**t, "markov_head.markov_w2.weight_scale": t["markov_head.markov_w2.weight_scale"][:, :0].contiguous()},
              str(path / "model.safetensors"))
    assert "markov_head.markov_w2.weight_scale" in _error(load_block_draft_checkpoint, path)


# --- TensorRT lowering --------------------------------------------------------------------------------
_record_block = record_block_draft


@pytest.mark.parametrize("name", BLOCK)
def test_recorded_block_network_matches_eager(name):
    """B=2 ragged context chunk (lengths 3 and 1, one sequence continuing after cached rows) plus a
    block of 3 rows, then a second step on the returned state."""
    module, ref = _load(name)
    rec = _record_block(module)
    assert {"rope", "attention", "kv_cache_update", "gather_rows"} <= set(rec.lowerings)
    state = _state(module, 2, scale=0.5, seed=1)
    for step, (starts, ends) in enumerate([([0, 2], [3, 3]), ([3, 3], [5, 4])]):
        aux, cpos, clen = _context(ref, ends, starts)
        anchors = torch.tensor(ends)
        ids, pos, lens, index = module.block_inputs(ref["input_ids"][[0, 1], ends], anchors, 3 - module.first_draft_row)
        feeds = {"aux": aux, "context_positions": cpos, "context_lengths": clen, "input_ids": ids, "positions": pos,
                 "lengths": lens, "logit_index": index}
        if module.kind == "dspark":
            feeds["prev_ids"] = torch.randint(0, 96, tuple(index.shape), generator=torch.Generator().manual_seed(step),
                                              dtype=I32)
        got = run_network(rec.network, {**feeds, **{"past." + n: v for n, v in state.items()}})
        want, new_state = module.forward(aux, cpos, clen, ids, pos, lens, index, {n: v.clone() for n, v in state.items()})
        torch.testing.assert_close(got["logits"], want, **REF)
        if module.kind == "dspark":
            torch.testing.assert_close(got["markov_logits"], module.markov_logits(want, feeds["prev_ids"]), **REF)
        for n, v in new_state.items():
            torch.testing.assert_close(got["present." + n], v, **REF, msg=n)
        state = new_state


def test_recorded_peagle_network_matches_eager():
    module, ref = _load("peagle_speculators")
    rec = NetworkRecorder()
    inp = {n: rec.add_input(n, I32, s) for n, s in [("input_ids", (-1, -1)), ("is_mask", (-1, -1)),
                                                    ("positions", (-1, -1)), ("lengths", (-1,)),
                                                    ("logit_index", (-1, -1))]}
    aux = rec.add_input("aux", module.dtype, (-1, -1, module.aux_width))
    state = {n: rec.add_input("past." + n, d, (-1, -1) + tuple(s[2:])) for n, (s, d) in module.state_spec(1, 1).items()}
    logits, new_state = module.forward(inp["input_ids"], aux, inp["is_mask"], inp["positions"], inp["lengths"],
                                       inp["logit_index"], state)
    rec.mark_output("logits", logits)
    for n, t in new_state.items():
        rec.mark_output("present." + n, t)
    state = _state(module, 2, scale=0.5, seed=2)
    feeds = module.step_inputs([ref["input_ids"][0, :4].tolist(), ref["input_ids"][1, :2].tolist()],
                               [ref["aux"][0, :4], ref["aux"][1, :2]], [0, 3], 3)
    names = ["input_ids", "aux", "is_mask", "positions", "lengths", "logit_index"]
    got = run_network(rec.network, {**dict(zip(names, feeds)), **{"past." + n: v for n, v in state.items()}})
    want, new_state = module.forward(*feeds, {n: v.clone() for n, v in state.items()})
    torch.testing.assert_close(got["logits"], want, **REF)
    for n, v in new_state.items():
        torch.testing.assert_close(got["present." + n], v, **REF, msg=n)


def test_recorded_dflash_network_builds():
    """TensorRT accepts the DFlash network with dynamic batch, context rows, block rows and cache."""
    from builder.backends.trt_build import build_engine_bytes
    module, _ = _load("dflash_speculators")
    rec = _record_block(module)
    assert len(build_engine_bytes(rec, [dynamic_profile(rec)])) > 1000


# --- validation ----------------------------------------------------------------------------------------
def _copy(tmp_path, name):
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name, ignore=shutil.ignore_patterns("reference.*")))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    (path / "config.json").write_text(json.dumps(cfg))


_error = draft_error


def test_error_hidden_size_and_vocab():
    cfg = load_block_draft_config(FIXTURES / "dflash_speculators")
    assert "hidden_size 32 does not match the target's hidden_size 48" in _error(
        validate_block_draft, cfg, SimpleNamespace(hidden_size=48, vocab_size=96, num_layers=6))
    assert "target_hidden_size 64" in _error(validate_block_draft, dataclasses.replace(cfg, target_hidden_size=64),
                                             TARGET)
    msg = _error(validate_block_draft, cfg, SimpleNamespace(hidden_size=32, vocab_size=112, num_layers=6))
    assert "transformer_layer_config.vocab_size (target vocabulary) 96" in msg and "112" in msg
    peagle = load_block_draft_config(FIXTURES / "peagle_speculators")
    assert "peagle draft: hidden_size 32" in _error(validate_block_draft, peagle,
                                                    SimpleNamespace(hidden_size=48, vocab_size=96, num_layers=6))
    assert "mask_token_id 200" in _error(validate_block_draft, dataclasses.replace(peagle, mask_token_id=200), TARGET)


def test_error_layer_ids_out_of_range():
    small = SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=4)
    msg = _error(validate_block_draft, load_block_draft_config(FIXTURES / "dflash_speculators"), small)
    assert "aux_hidden_state_layer_ids [1, 3, 5] has id 5 outside" in msg
    msg = _error(validate_block_draft, load_block_draft_config(FIXTURES / "dspark_zlab"), small)
    assert "dflash_config.target_layer_ids [1, 3, 4]" in msg and "id 4 outside" in msg
    cfg = load_block_draft_config(FIXTURES / "dspark_speculators")
    assert "repeats a layer id" in _error(validate_block_draft, dataclasses.replace(cfg, target_layer_ids=(2, 2, 6)),
                                          TARGET)
    assert validate_block_draft(dataclasses.replace(cfg, target_layer_ids=(6, 0, 2)), TARGET).target_layer_ids == (0, 2, 6)
    msg = _error(validate_block_draft, load_block_draft_config(FIXTURES / "peagle_speculators"),
                 SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=3))
    assert "peagle draft: eagle_aux_hidden_state_layer_ids [1, 3, 4]" in msg and "id 4 outside [0, 3]" in msg


def test_error_markov_head_type(tmp_path):
    path = _copy(tmp_path, "dspark_speculators")
    _edit_config(path, markov_head_type="gated")
    assert "field 'markov_head_type' is 'gated': only the vanilla" in _error(load_block_draft_checkpoint, path)
    _edit_config(path, markov_head_type="lstm")
    assert "field 'markov_head_type' is 'lstm': unknown Markov head type" in _error(load_block_draft_checkpoint, path)


def test_error_config_fields(tmp_path):
    path = _copy(tmp_path, "dflash_speculators")
    _edit_config(path, mask_token_id=None)
    assert "field 'mask_token_id' is missing" in _error(load_block_draft_checkpoint, path)
    path = _copy(tmp_path, "dspark_speculators")
    _edit_config(path, transformer_layer_config__layer_types=["sliding_attention"])
    assert "'transformer_layer_config.layer_types' has 'sliding_attention'" in _error(load_block_draft_checkpoint, path)
    path = _copy(tmp_path, "dspark_zlab")
    _edit_config(path, dflash_config__attention_sink_bias=True)
    assert "'dflash_config.attention_sink_bias' is true" in _error(load_block_draft_checkpoint, path)
    _edit_config(path, dflash_config__attention_sink_bias=None, dflash_config__target_layer_ids=None)
    assert "'dflash_config.target_layer_ids' is missing" in _error(load_block_draft_checkpoint, path)
    path = _copy(tmp_path, "peagle_speculators")
    _edit_config(path, speculators_model_type="medusa")
    assert "field 'speculators_model_type' is 'medusa'" in _error(load_block_draft_checkpoint, path)


def test_error_tensors(tmp_path):
    path = _copy(tmp_path, "dspark_speculators")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(path / "model.safetensors"))
    assert "missing tensor 'd2t'" in _error(load_block_draft_checkpoint, path)
    save_file({**tensors, "markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][:, :4].contiguous()},
              str(path / "model.safetensors"))
    assert "tensor 'markov_head.markov_w2.weight' has shape [64, 4], expected [64, 8]" in _error(
        load_block_draft_checkpoint, path)
    path = _copy(tmp_path, "dspark_zlab")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.qkv_proj.weight": tensors["model.layers.0.self_attn.qkv_proj.weight"][:60]},
              str(path / "model.safetensors"))
    assert "expected 64 rows (32 + 16 + 16)" in _error(load_block_draft_checkpoint, path)
    path = _copy(tmp_path, "peagle_speculators")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, str(path / "model.safetensors"))
    assert "missing tensor 'mask_hidden', expected shape [1, 1, 96]" in _error(load_block_draft_checkpoint, path)


# --- driven by a real target ---------------------------------------------------------------------------
_GREEDY: dict = {}


@pytest.mark.parametrize("name", ["dflash_speculators", "dspark_speculators"])
def test_greedy_loop_with_nemotron_h_features(checkpoints, name):
    """The loop protocol on the tiny MoE NemotronH: the target captures ``target_layer_ids``; per
    step the verified rows' features are appended as context and a block runs from the bonus token.
    The draft's incremental state (stale block rows never rolled back) gives the same block logits
    as a fresh state holding the whole context, and greedy verification reproduces target-only
    greedy decoding."""
    from builder.checkpoint import load_checkpoint
    from builder.models.nemotron_h import NemotronH
    cfg, weights = load_checkpoint(checkpoints["moe"])
    module, _ = _load(name)
    validate_block_draft(load_block_draft_config(FIXTURES / name), cfg)
    target = NemotronH(cfg, weights, capture_layers=module.target_layer_ids)
    K, total = 3, 10

    def run_target(tokens):
        n = len(tokens)
        state = {k: torch.zeros(s, dtype=d) for k, (s, d) in target.state_spec(1, 32).items()}
        logits, _, feats = target.forward(torch.tensor([tokens], dtype=I32), torch.arange(n, dtype=I32)[None],
                                          torch.tensor([n], dtype=I32), torch.arange(n, dtype=I32)[None], state)
        assert feats["aux_hidden"].shape[-1] == module.aux_width
        return logits[0].argmax(-1).tolist(), feats["aux_hidden"][0]

    prompt = [5, 17, 33, 3, 60]
    greedy = _GREEDY.get(str(checkpoints["moe"]))
    if greedy is None:  # target-only greedy decoding (the same for both drafts)
        greedy = list(prompt)
        while len(greedy) < len(prompt) + total:
            greedy.append(run_target(greedy)[0][-1])
        # the loop recomputes the target over sequences of other lengths: no near-tie may decide a token
        from runtime.runner import TorchRunner
        from speculative_fixtures import assert_greedy_margin
        assert_greedy_margin(TorchRunner(target), [prompt], [greedy[len(prompt):]], K)
        _GREEDY.clear()
        _GREEDY[str(checkpoints["moe"])] = greedy

    seq = list(prompt)
    preds, aux = run_target(seq)
    anchor, context_rows = preds[-1], (0, len(seq))  # context: features of rows [start, end)
    state = {n: torch.zeros(s, dtype=d) for n, (s, d) in module.state_spec(1, 32).items()}
    while len(seq) < len(prompt) + total:
        n = len(seq)
        start, end = context_rows
        ctx = (aux[None, start:end], torch.arange(start, end, dtype=I32)[None], torch.tensor([end - start], dtype=I32))
        block = module.block_inputs(torch.tensor([anchor]), torch.tensor([n]), K)
        logits, state = module.forward(*ctx, *block, state)
        fresh, _ = module.forward(aux[None, :end], torch.arange(end, dtype=I32)[None], torch.tensor([end], dtype=I32),
                                  *block, _state(module, 1, scale=1.0, seed=n, capacity=32))
        # cached context rows vs the whole context recomputed: the whole draft network in two orders (1e-5
        # was within 3x of what this CPU measured; REF is the file's whole-network tolerance)
        torch.testing.assert_close(logits, fresh, **REF)
        if module.kind == "dspark":
            drafts, _ = module.choose_block(logits, torch.tensor([anchor]), lambda row: row.argmax(-1))
        else:
            drafts = logits.argmax(-1)
        drafts = drafts[0] if module.d2t is None else drafts[0] + module.d2t[drafts[0]]
        preds, aux = run_target(seq + [anchor] + drafts.tolist())
        verified = preds[n:]                   # target's choice after anchor, d_1, .., d_K
        m = 0
        while m < K and int(drafts[m]) == verified[m]:
            m += 1
        seq += [anchor] + drafts[:m].tolist()
        anchor, context_rows = verified[m], (n, n + m + 1)  # features of the anchor and accepted drafts
    assert (seq + [anchor])[:len(greedy)] == greedy


def test_a_draft_length_past_the_trained_block_is_said_at_build():
    """The embedded DFlash draft was trained to propose 4 tokens a block; K = 6 drafts past them (its
    5th and 6th proposals are rarely kept), so build says so; K = 4, and a chain draft at any K, pass."""
    from builder import drafts, embedded
    from builder.checkpoint import load_checkpoint
    config, weights = load_checkpoint(embedded.target_dir())
    dflash = drafts.load_draft("dflash", config, weights, embedded.draft_dir("dflash"), torch.float32, log=lambda m: None)
    assert dflash.module.num_speculative_tokens == 4
    assert drafts.past_trained_block(dflash.module, "dflash", 4) is None
    note = drafts.past_trained_block(dflash.module, "dflash", 6)
    assert note.startswith("warning: the dflash draft was trained to propose 4 tokens a block; --max_draft_len 6")
    eagle3 = drafts.load_draft("eagle3", config, weights, embedded.draft_dir("eagle3"), torch.float32, log=lambda m: None)
    assert drafts.past_trained_block(eagle3.module, "eagle3", 8) is None
