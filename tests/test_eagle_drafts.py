"""EAGLE-3 and EAGLE drafts: parity with the speculators reference, TensorRT lowering, validation.

The fixtures in tests/fixtures/speculators were written by scripts/make_speculators_fixtures.py
(run in a separate venv with speculators 0.9.0): tiny bf16 checkpoints in four layouts and the
reference forward's fp32 outputs. This file needs no speculators: it loads each fixture with
``builder.draft_checkpoint`` and runs our drafts eagerly and through the recorded TensorRT network.
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

from builder.draft_checkpoint import (Eagle3Config, EagleConfig, draft_config_from_dict, load_draft_checkpoint,
                                      load_draft_config, validate_against_target)
from builder.interpreter import run_network
from builder.models.eagle import EagleDraft
from builder.models.eagle3 import Eagle3Draft
from draft_helpers import draft_error, record_draft

FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
EAGLE3 = ["eagle3_llama3", "eagle3_qwen3", "eagle3_specforge"]
EAGLE = ["eagle_speculators", "eagle_hf"]
TARGET = SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=6)  # tests/tiny_models.py MOE
REF = dict(rtol=1e-4, atol=1e-4)
CAPACITY = 16


def _load(name, dtype=torch.float32):
    cfg, weights = load_draft_checkpoint(FIXTURES / name)
    cfg = validate_against_target(cfg, TARGET)
    ref = load_file(str(FIXTURES / name / "reference.safetensors"))
    emb, head = ref.get("target_embedding"), ref.get("target_lm_head")
    if cfg.kind == "eagle3":
        module = Eagle3Draft(cfg, weights, None if emb is None else emb.float(), dtype)
    else:
        module = EagleDraft(cfg, weights, emb.float(), head.float(), dtype)
    return module, ref


def _state(module, batch):
    return {n: torch.zeros(s, dtype=d) for n, (s, d) in module.state_spec(batch, CAPACITY).items()}


def _run(module, ids, feature, positions, lengths, index, state, from_target=None):
    """One forward; ``feature`` is aux (eagle3, target rows) or hidden; from_target None: all rows
    from the target (eagle3) / the feature is the hidden (eagle)."""
    if module.kind == "eagle3":
        batch, rows = ids.shape
        if from_target is None:
            aux, hidden = feature, torch.zeros(batch, rows, module.hidden_size, dtype=module.dtype)
            from_target = torch.ones(batch, rows, dtype=torch.int32)
        else:
            aux, hidden = torch.zeros(batch, rows, module.aux_width, dtype=module.dtype), feature
        return module.forward(ids, aux, hidden, from_target, positions, lengths, index, state)
    return module.forward(ids, feature, positions, lengths, index, state)


def _feature(ref):
    return ref["aux"] if "aux" in ref else ref["hidden"]


# --- checkpoints ---------------------------------------------------------------------------------------
def test_fixture_configs():
    cfg = load_draft_config(FIXTURES / "eagle3_llama3")
    assert isinstance(cfg, Eagle3Config) and cfg.source == "speculators" and cfg.layer_type == "llama"
    assert (cfg.draft_vocab_size, cfg.target_vocab_size, cfg.aux_layer_ids) == (64, 96, (1, 3, 4))
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and cfg.rope_theta == 500000.0 and cfg.has_embedding
    qwen = load_draft_config(FIXTURES / "eagle3_qwen3")
    assert qwen.qk_norm and qwen.num_hidden_layers == 2 and qwen.norm_before_residual and qwen.fc_norm
    assert qwen.norm_output and not qwen.has_d2t
    forge = load_draft_config(FIXTURES / "eagle3_specforge")
    assert forge.source == "eagle3_hf" and not forge.has_embedding and forge.aux_layer_ids == (1, 3, 4)
    spec = load_draft_config(FIXTURES / "eagle_speculators")
    assert isinstance(spec, EagleConfig) and spec.fc_bias and spec.embedding_norm and spec.final_norm
    assert spec.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    hf = load_draft_config(FIXTURES / "eagle_hf")
    assert hf.source == "eagle_hf" and hf.fc_bias and not hf.first_input_norm and not hf.final_norm
    assert hf.num_hidden_layers == 2 and not hf.has_embedding and not hf.has_lm_head
    for c in (cfg, qwen, forge, spec, hf):
        assert draft_config_from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_weights_are_canonical():
    _, w = load_draft_checkpoint(FIXTURES / "eagle3_specforge")
    assert "layers.0.hidden_norm.weight" in w and not any(n.startswith("midlayer.") for n in w)
    assert w["d2t"].dtype == torch.int64 and "t2d" not in w
    _, w = load_draft_checkpoint(FIXTURES / "eagle_speculators")
    assert {"fc.weight", "fc.bias", "embedding_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"} <= set(w)


def test_d2t_maps_into_the_target_vocabulary():
    module, _ = _load("eagle3_llama3")
    target_ids = torch.arange(64) + module.d2t
    assert module.d2t.dtype == torch.int64 and len(set(target_ids.tolist())) == 64
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < 96
    assert _load("eagle3_qwen3")[0].d2t is None


# --- parity with the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("name", EAGLE3 + EAGLE)
def test_prefill_matches_reference(name):
    """A ragged batch of catch-up rows (B=2, lengths 6 and 4): logits of every row and hidden_out."""
    module, ref = _load(name)
    ids, lengths = ref["input_ids"], ref["lengths"]
    batch, rows = ids.shape
    index = torch.arange(rows, dtype=torch.int32).repeat(batch, 1)
    logits, hidden, _ = _run(module, ids, _feature(ref), ref["positions"], lengths, index, _state(module, batch))
    assert logits.dtype == torch.float32 and logits.shape == ref["logits"].shape
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(logits[b, :n], ref["logits"][b, :n], **REF)
        torch.testing.assert_close(hidden[b, :n], ref["hidden_out"][b, :n], **REF)
        assert not hidden[b, n:].any()  # padding rows are zeroed


@pytest.mark.parametrize("name", EAGLE3 + EAGLE)
def test_chain_steps_match_reference(name):
    """Catch up to row i, then chain T=1 steps on the recycled hidden at positions p_i + 1, p_i + 2
    (EAGLE-3: speculators' TTT steps 2 and 3)."""
    module, ref = _load(name)
    ids, positions = ref["input_ids"], ref["positions"]
    batch, rows = ids.shape
    chain_rows = ref["chain_rows"]
    for r in range(chain_rows.shape[1]):
        last = chain_rows[:, r]
        state = _state(module, batch)
        logits, hidden, state = _run(module, ids, _feature(ref), positions, (last + 1).int(), last[:, None].int(), state)
        hidden = hidden[torch.arange(batch), last.long()][:, None]
        pos = positions[torch.arange(batch), last.long()][:, None]
        for s in range(ref["chain_ids"].shape[2]):
            pos = pos + 1
            logits, hidden, state = _run(module, ref["chain_ids"][:, r, s, None], hidden, pos,
                                         torch.ones(batch, dtype=torch.int32), torch.zeros(batch, 1, dtype=torch.int32),
                                         state, from_target=torch.zeros(batch, 1, dtype=torch.int32))
            torch.testing.assert_close(logits[:, 0], ref["chain_logits"][:, r, s], **REF, msg=f"row {r} step {s}")
            torch.testing.assert_close(hidden[:, 0], ref["chain_hidden"][:, r, s], **REF, msg=f"row {r} step {s}")


def test_eagle3_mixed_rows_select_per_row():
    """from_target picks fc(aux) or the recycled hidden row by row within one chunk."""
    module, ref = _load("eagle3_llama3")
    ids, aux, pos = ref["input_ids"][:, :3], ref["aux"][:, :3], ref["positions"][:, :3]
    hidden = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(5))
    mixed = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.int32)
    lengths, index = torch.tensor([3, 3], dtype=torch.int32), torch.tensor([[0, 1, 2]] * 2, dtype=torch.int32)
    got = module.forward(ids, aux, hidden, mixed, pos, lengths, index, _state(module, 2))
    # the same chunk with fc(aux) precomputed into the recycled rows
    merged = torch.where(mixed[..., None] == 1, torch.nn.functional.linear(aux, module.fc), hidden)
    want = module.forward(ids, torch.zeros_like(aux), merged, torch.zeros_like(mixed), pos, lengths, index,
                          _state(module, 2))
    # the same ops on the same values in the same order (fc(aux) on the whole chunk, then a select): bit for
    # bit on any CPU, so exact; a tolerance would hide a row taken from the wrong source only if it were tiny
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    swapped = module.forward(ids, aux, hidden, 1 - mixed, pos, lengths, index, _state(module, 2))
    assert not torch.equal(swapped[0], want[0])


def test_bf16_draft_runs_close_to_reference():
    module, ref = _load("eagle3_llama3", torch.bfloat16)
    ids, lengths = ref["input_ids"], ref["lengths"]
    index = (lengths - 1)[:, None].int()
    logits, hidden, _ = _run(module, ids, ref["aux"].bfloat16(), ref["positions"], lengths, index, _state(module, 2))
    assert logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    want = ref["logits"][torch.arange(2), (lengths - 1).long()]
    assert (logits[:, 0] - want).abs().max() < 0.05 * want.abs().max()


# --- TensorRT lowering --------------------------------------------------------------------------------
_record = record_draft


def _compare(rec, module, feeds, state):
    got = run_network(rec.network, {**feeds, **{"past." + n: v for n, v in state.items()}})
    state = {n: v.clone() for n, v in state.items()}
    if module.kind == "eagle3":
        want = module.forward(feeds["input_ids"], feeds["aux"], feeds["hidden"], feeds["from_target"],
                              feeds["positions"], feeds["lengths"], feeds["logit_index"], state)
    else:
        want = module.forward(feeds["input_ids"], feeds["hidden"], feeds["positions"], feeds["lengths"],
                              feeds["logit_index"], state)
    torch.testing.assert_close(got["logits"], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["hidden_out"], want[1], rtol=1e-4, atol=1e-4)
    assert set(got) == {"logits", "hidden_out"} | {"present." + n for n in want[2]}
    for n, v in want[2].items():
        torch.testing.assert_close(got["present." + n], v, rtol=1e-4, atol=1e-4, msg=n)
    return want


@pytest.mark.parametrize("name", ["eagle3_llama3", "eagle3_qwen3", "eagle_speculators", "eagle_hf"])
def test_recorded_network_matches_eager(name):
    """Prefill-like chunk (B=2 ragged, T=4), then a T=1 step on the recycled hidden."""
    module, ref = _load(name)
    rec = _record(module)
    assert {"rope", "attention", "kv_cache_update"} <= set(rec.lowerings)
    g = torch.Generator().manual_seed(7)
    batch, rows = 2, 4
    lengths = torch.tensor([4, 2], dtype=torch.int32)
    start = torch.tensor([[3], [0]], dtype=torch.int32)  # sequence 0 continues after 3 cached rows
    positions = start + torch.arange(rows, dtype=torch.int32)
    state = {n: torch.randn(s, generator=g) * 0.5 for n, (s, _) in module.state_spec(batch, CAPACITY).items()}
    feeds = {"input_ids": ref["input_ids"][:, :rows].contiguous(), "positions": positions, "lengths": lengths,
             "logit_index": torch.tensor([[3, 1], [1, 0]], dtype=torch.int32)}
    if module.kind == "eagle3":
        feeds.update(aux=ref["aux"][:, :rows].contiguous(), hidden=torch.randn(batch, rows, 32, generator=g),
                     from_target=torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.int32))
    else:
        feeds["hidden"] = ref["hidden"][:, :rows].contiguous()
    _, hidden, state = _compare(rec, module, feeds, state)
    last = (lengths - 1).long()
    step = {"input_ids": torch.tensor([[5], [7]], dtype=torch.int32), "positions": positions[torch.arange(2), last][:, None] + 1,
            "lengths": torch.ones(2, dtype=torch.int32), "logit_index": torch.zeros(2, 1, dtype=torch.int32),
            "hidden": hidden[torch.arange(2), last][:, None].contiguous()}
    if module.kind == "eagle3":
        step.update(aux=torch.zeros(batch, 1, module.aux_width), from_target=torch.zeros(batch, 1, dtype=torch.int32))
    _compare(rec, module, step, state)


def test_recorded_eagle3_network_builds():
    """TensorRT accepts the recorded EAGLE-3 network with dynamic batch, rows and cache length."""
    from builder.backends.trt_build import build_engine_bytes
    module, _ = _load("eagle3_llama3")
    rec = _record(module)
    profile = {}
    for i in range(rec.network.num_inputs):
        t = rec.network.get_input(i)
        tail = tuple(d for d in t.shape[2:])
        if t.name == "lengths":
            profile[t.name] = [(1,), (2,), (4,)]
        elif t.name.startswith("past."):
            profile[t.name] = [(1, 1) + tail, (2, 64) + tail, (4, 256) + tail]
        else:
            profile[t.name] = [(1, 1) + tail, (2, 8) + tail, (4, 64) + tail]
    assert len(build_engine_bytes(rec, [profile])) > 1000


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


def _drop_tensor(path, name):
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


_error = draft_error


def test_validate_against_a_real_target_config():
    from tiny_models import MOE

    from builder.config import parse_hf_config
    target = parse_hf_config({"model_type": "nemotron_h", **MOE})
    for name in EAGLE3 + EAGLE:
        cfg = validate_against_target(load_draft_config(FIXTURES / name), target)
        assert cfg.kind in ("eagle", "eagle3")


def test_error_hidden_size_mismatch():
    cfg = load_draft_config(FIXTURES / "eagle3_llama3")
    assert "hidden_size 32 does not match the target's hidden_size 48" in _error(
        validate_against_target, cfg, SimpleNamespace(hidden_size=48, vocab_size=96, num_layers=6))
    cfg = dataclasses.replace(cfg, target_hidden_size=64)
    assert "target_hidden_size 64" in _error(validate_against_target, cfg, TARGET)
    eagle = load_draft_config(FIXTURES / "eagle_hf")
    assert "hidden_size 32" in _error(validate_against_target, eagle,
                                      SimpleNamespace(hidden_size=64, vocab_size=96, num_layers=6))


def test_error_vocab_mismatch():
    msg = _error(validate_against_target, load_draft_config(FIXTURES / "eagle3_llama3"),
                 SimpleNamespace(hidden_size=32, vocab_size=112, num_layers=6))
    assert "vocab_size (target vocabulary) 96" in msg and "112" in msg
    msg = _error(validate_against_target, load_draft_config(FIXTURES / "eagle_speculators"),
                 SimpleNamespace(hidden_size=32, vocab_size=128, num_layers=6))
    assert "vocab_size 96" in msg


def test_error_missing_d2t(tmp_path):
    path = _copy(tmp_path, "eagle3_llama3")
    _drop_tensor(path, "d2t")
    msg = _error(load_draft_checkpoint, path)
    assert "'d2t'" in msg and "draft_vocab_size 64 != target vocab_size 96" in msg
    cfg = dataclasses.replace(load_draft_config(FIXTURES / "eagle3_llama3"), has_d2t=False)
    assert "no d2t" in _error(validate_against_target, cfg, TARGET)


def test_error_aux_layer_ids_out_of_range():
    cfg = load_draft_config(FIXTURES / "eagle3_llama3")
    msg = _error(validate_against_target, cfg, SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=3))
    assert "eagle_aux_hidden_state_layer_ids [1, 3, 4]" in msg and "id 4 outside [0, 3]" in msg
    shuffled = dataclasses.replace(cfg, aux_layer_ids=(4, 1, 3))
    assert validate_against_target(shuffled, TARGET).aux_layer_ids == (1, 3, 4)  # vLLM's capture order
    assert "repeats a layer id" in _error(validate_against_target, dataclasses.replace(cfg, aux_layer_ids=(1, 1, 3)),
                                          TARGET)
    unset = dataclasses.replace(cfg, aux_layer_ids=None)
    assert validate_against_target(unset, SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=40)).aux_layer_ids \
        == (2, 20, 37)
    assert "vLLM's default" in _error(validate_against_target, unset,
                                      SimpleNamespace(hidden_size=32, vocab_size=96, num_layers=2))


def test_error_unknown_architecture_and_type(tmp_path):
    path = _copy(tmp_path, "eagle3_specforge")
    _edit_config(path, architectures=["MedusaForCausalLM"])
    msg = _error(load_draft_checkpoint, path)
    assert "field 'architectures' is 'MedusaForCausalLM': unknown draft architecture" in msg
    path = _copy(tmp_path, "eagle3_llama3")
    _edit_config(path, speculators_model_type="dflash")
    assert "field 'speculators_model_type' is 'dflash'" in _error(load_draft_checkpoint, path)


def test_error_config_fields(tmp_path):
    path = _copy(tmp_path, "eagle3_llama3")
    _edit_config(path, transformer_layer_config__rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})
    assert "'transformer_layer_config.rope_parameters.rope_type' is 'longrope'" in _error(load_draft_checkpoint, path)
    _edit_config(path, transformer_layer_config__rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    assert "'transformer_layer_config.rope_parameters.original_max_position_embeddings' is missing" in _error(
        load_draft_checkpoint, path)
    _edit_config(path, transformer_layer_config__rope_parameters=None, transformer_layer_config__hidden_size=None)
    assert "'transformer_layer_config.hidden_size' is missing" in _error(load_draft_checkpoint, path)
    path = _copy(tmp_path, "eagle_speculators")
    _edit_config(path, transformer_layer_config__model_type="mistral3")
    assert "'transformer_layer_config.model_type' is 'mistral3'" in _error(load_draft_checkpoint, path)


def test_error_tensors(tmp_path):
    path = _copy(tmp_path, "eagle3_specforge")
    _drop_tensor(path, "midlayer.hidden_norm.weight")
    assert "missing tensor 'layers.0.hidden_norm.weight'" in _error(load_draft_checkpoint, path)
    path = _copy(tmp_path, "eagle_hf")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "fc.weight": tensors["fc.weight"][:, :40].contiguous()}, str(path / "model.safetensors"))
    assert "tensor 'fc.weight' has shape [32, 40], expected [32, 64]" in _error(load_draft_checkpoint, path)
    save_file({**tensors, "extra.weight": torch.zeros(2)}, str(path / "model.safetensors"))
    assert "unexpected tensor 'extra.weight' for an eagle draft" in _error(load_draft_checkpoint, path)
    save_file({**tensors, "fc.weight": tensors["fc.weight"].to(torch.int32)}, str(path / "model.safetensors"))
    assert "tensor 'fc.weight' has dtype I32" in _error(load_draft_checkpoint, path)
    (path / "config.json").unlink()
    assert "config.json: missing" in _error(load_draft_checkpoint, path)
