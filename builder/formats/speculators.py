"""speculators layouts (``speculators_model_type``): eagle3 (0.9.0 ``Eagle3DraftModel``), eagle
(EAGLE-1/2 and HASS, speculators before 0.9.0), dflash, dspark, peagle.

* ``eagle3``: ``transformer_layer_config`` (``model_type`` ``llama`` or ``qwen3``; ``hidden_size``,
  ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``rms_norm_eps``, ``hidden_act``, ``attention_bias``, ``mlp_bias``, ``vocab_size`` =
  the target's vocabulary, ``rope_parameters`` or ``rope_theta``/``rope_scaling``,
  ``partial_rotary_factor``), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``,
  ``norm_output``, ``speculators_config.verifier.{name_or_path, architectures}``. Tensors
  ``embed_tokens.weight`` (optional), ``fc.weight``, ``input_norm.weight`` (norm_before_fc),
  ``fc_norm.{i}.weight`` (fc_norm), ``layers.{i}.*`` (``midlayer.*`` read as ``layers.0.*``),
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``.
* ``eagle``: ``transformer_layer_config`` (llama), ``layernorms``, ``fusion_bias``; tensors
  ``fusion_fc.weight``/``.bias``, ``embedding_layernorm.weight``, ``transformer.*`` (one Llama
  decoder layer), ``pre_lm_head_layernorm.weight``; canonical ``fc.*``, ``embedding_norm.weight``,
  ``layers.0.*``, ``norm.weight``.
* ``dflash`` / ``dspark``: ``transformer_layer_config`` (Qwen3 fields; ``vocab_size`` = the target's
  vocabulary; ``layer_types`` all full attention), ``draft_vocab_size``, ``block_size``,
  ``target_hidden_size``, ``aux_hidden_state_layer_ids`` (Hugging Face ``hidden_states`` ids: id i
  is the hidden state entering target layer i), ``mask_token_id``, ``sample_from_anchor`` (absent:
  false for dflash, true for dspark, speculators' own defaults), and for dspark ``markov_rank``,
  ``markov_head_type`` (only ``vanilla``), ``enable_confidence_head``,
  ``confidence_head_with_markov``. Tensors ``fc.weight`` [H, k*Ht], ``hidden_norm.weight``,
  ``norm.weight``, ``layers.{i}.*``, ``lm_head.weight`` (only for a reduced draft vocabulary),
  optional ``embed_tokens.weight``, ``d2t`` / ``t2d``, dspark ``markov_head.markov_w1.weight``
  [Vt, r], ``markov_head.markov_w2.weight`` [Vd, r], ``confidence_head.proj.{weight,bias}``.
* ``peagle`` (``PEagleDraftModel``): every eagle3 field plus ``mask_token_id``; eagle3's tensors
  plus ``mask_hidden`` [1, 1, k*Ht] (the hidden-state placeholder of the parallel rows).
"""
from __future__ import annotations

import dataclasses

from builder.formats.fields import (Fields, aux_layer_ids, layer_fields, markov_fields, proposal_tokens,
                                    refuse_sliding, verifier_fields)
from builder.formats.reader import Layout
from builder.models.draft_configs import DFlashConfig, DSparkConfig, Eagle3Config, EagleConfig, PEagleConfig

FEATURE_TYPES = ("eagle", "eagle3")
BLOCK_TYPES = ("dflash", "dspark", "peagle")


def parse_eagle3(f: Fields, names: set[str]) -> Eagle3Config:
    layer = f.obj("transformer_layer_config")
    layers = layer_fields(layer, layer.str("model_type", "llama"))
    target_vocab = layer.int("vocab_size")
    aux = aux_layer_ids(f)
    norm_before_fc, fc_norm = f.bool("norm_before_fc"), f.bool("fc_norm")
    if norm_before_fc and fc_norm:
        raise f.fail("fc_norm", "and norm_before_fc are mutually exclusive")
    return Eagle3Config(
        source="speculators", architecture="Eagle3DraftModel", **layers, **verifier_fields(f),
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        aux_layer_ids=aux, num_aux=3 if aux is None else len(aux),
        norm_before_residual=f.bool("norm_before_residual"), norm_before_fc=norm_before_fc,
        fc_norm=fc_norm, norm_output=f.bool("norm_output"),
        has_embedding="embed_tokens.weight" in names, has_d2t="d2t" in names)



def parse_eagle(f: Fields, names: set[str]) -> EagleConfig:
    arch = f.str("transformer_layer_architecture", "LlamaDecoderLayer")
    if arch != "LlamaDecoderLayer":
        raise f.fail("transformer_layer_architecture", f"is {arch!r}: only LlamaDecoderLayer is supported")
    layer = f.obj("transformer_layer_config")
    layers = layer_fields(layer, layer.str("model_type", "llama"))
    if layers["num_hidden_layers"] != 1:
        # the speculators eagle class builds exactly one decoder layer whatever the config says
        layers["num_hidden_layers"] = 1
    norms = f.bool("layernorms")
    return EagleConfig(
        source="speculators", architecture="EagleSpeculator", **layers, **verifier_fields(f),
        vocab_size=layer.int("vocab_size"), fc_bias=f.bool("fusion_bias"), embedding_norm=norms,
        first_input_norm=norms, final_norm=norms, has_embedding="embed_tokens.weight" in names,
        has_lm_head="lm_head.weight" in names)



def parse_dflash(f: Fields, kind: str, names: set[str]) -> DFlashConfig:
    layer = f.obj("transformer_layer_config")
    refuse_sliding(layer, None)
    layers = layer_fields(layer, layer.str("model_type", "qwen3"))
    target_vocab = layer.int("vocab_size")
    ids = f.int_list("aux_hidden_state_layer_ids")
    if ids is None:
        raise f.fail("aux_hidden_state_layer_ids", "is missing: a DFlash draft names the target layers it reads")
    mask = f.int("mask_token_id", None, minimum=0)
    if mask is None:
        raise f.fail("mask_token_id", "is missing: DFlash block rows after the anchor embed the mask token")
    cls = DSparkConfig if kind == "dspark" else DFlashConfig
    extra = markov_fields(f, kind, names)
    if kind == "dspark" and extra["markov_rank"] == 0 and "markov_head.markov_w1.weight" in names:
        raise f.fail("markov_rank", "is 0 but the checkpoint has Markov head tensors")
    return cls(
        source="speculators", architecture="DSparkDraftModel" if kind == "dspark" else "DFlashDraftModel",
        **layers, **verifier_fields(f), target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        target_layer_ids=ids, block_size=f.int("block_size", 8), mask_token_id=mask,
        sample_from_anchor=f.bool("sample_from_anchor", kind == "dspark"),
        num_speculative_tokens=proposal_tokens(f),
        embedding_rows=target_vocab if "embed_tokens.weight" in names else 0,  # its own (a widened target's draft)
        has_lm_head="lm_head.weight" in names, has_d2t="d2t" in names, **extra)



def parse_peagle(f: Fields, names: set[str], shapes=None) -> PEagleConfig:
    e3 = parse_eagle3(f, names)
    mask = f.int("mask_token_id", None, minimum=0)
    if mask is None:
        raise f.fail("mask_token_id", "is missing: P-EAGLE parallel rows embed the mask token")
    fields = {k.name: getattr(e3, k.name) for k in dataclasses.fields(e3)}
    fields.update(architecture="PEagleDraftModel", mask_token_id=mask, num_speculative_tokens=proposal_tokens(f))
    return PEagleConfig(**fields)


_EAGLE_NAMES = {"fusion_fc.": "fc.", "embedding_layernorm.": "embedding_norm.",
                "transformer.": "layers.0.", "pre_lm_head_layernorm.": "norm."}


def _eagle_name(stored: str) -> str:
    for old, new in _EAGLE_NAMES.items():
        if stored.startswith(old):
            return new + stored[len(old):]
    return stored


def midlayer_name(stored: str) -> str:
    """EAGLE-3's single decoder layer stored as ``midlayer.*``."""
    return "layers.0." + stored[len("midlayer."):] if stored.startswith("midlayer.") else stored


def _block_name(stored: str) -> str:
    return "d2t" if stored == "draft_id_to_target_id" else stored


LAYOUTS = {
    "eagle3": Layout("speculators eagle3", lambda f, names, shapes: parse_eagle3(f, names), midlayer_name),
    "eagle": Layout("speculators eagle", lambda f, names, shapes: parse_eagle(f, names), _eagle_name),
    "dflash": Layout("speculators dflash", lambda f, names, shapes: parse_dflash(f, "dflash", names), _block_name),
    "dspark": Layout("speculators dspark", lambda f, names, shapes: parse_dflash(f, "dspark", names), _block_name),
    "peagle": Layout("speculators peagle", parse_peagle, _block_name),
}
