"""The original EAGLE / EAGLE-3 layouts (SafeAILab, SpecForge, SGLang), read from ``architectures``.

* EAGLE-3, ``architectures: ["LlamaForCausalLMEagle3"]`` (also ``Eagle3LlamaForCausalLM``): Llama
  fields at the top level, ``vocab_size`` (target), ``draft_vocab_size``, ``target_hidden_size``, aux
  layer ids in ``eagle_aux_hidden_state_layer_ids`` or ``eagle_config.eagle_aux_hidden_state_layer_ids``,
  optional ``norm_before_residual``; tensors ``midlayer.*`` (read as ``layers.0.*``), ``fc.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, optional ``embed_tokens.weight``.
* EAGLE, ``architectures: ["LlamaForCausalLMEagle"]`` (also ``EagleLlamaForCausalLM``, or
  ``LlamaForCausalLM`` when the tensors hold ``fc.weight`` [H, 2H]): ``fc.weight`` (+ ``fc.bias``
  when stored), ``layers.{i}.*`` with no ``input_layernorm`` in layer 0, optional ``norm.weight``,
  ``embed_tokens.weight``, ``lm_head.weight``; a ``model.`` prefix is dropped.
"""
from __future__ import annotations

from builder.formats.fields import Fields, aux_layer_ids, layer_fields
from builder.formats.reader import Layout, strip_model_prefix
from builder.formats.speculators import midlayer_name
from builder.models.draft_configs import Eagle3Config, EagleConfig

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def parse_eagle3_hf(f: Fields, arch: str, names: set[str]) -> Eagle3Config:
    layers = layer_fields(f, "llama")
    target_vocab = f.int("vocab_size")
    aux = aux_layer_ids(f)
    eagle = f.obj("eagle_config", required=False)
    if eagle is not None and eagle.get("use_aux_hidden_state", True) is False:
        raise eagle.fail("use_aux_hidden_state", "is false: EAGLE-3 drafts without aux hidden states are not supported")
    return Eagle3Config(
        source="eagle3_hf", architecture=arch, **layers,
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        aux_layer_ids=aux, num_aux=3 if aux is None else len(aux),
        norm_before_residual=f.bool("norm_before_residual"), norm_before_fc=f.bool("norm_before_fc"),
        fc_norm=f.bool("fc_norm"), norm_output=f.bool("norm_output"),
        has_embedding="embed_tokens.weight" in names, has_d2t="d2t" in names)



def parse_eagle_hf(f: Fields, arch: str, names: set[str]) -> EagleConfig:
    layers = layer_fields(f, "llama")
    return EagleConfig(
        source="eagle_hf", architecture=arch, **layers, vocab_size=f.int("vocab_size"),
        fc_bias="fc.bias" in names, embedding_norm=False, first_input_norm="layers.0.input_layernorm.weight" in names,
        final_norm="norm.weight" in names, has_embedding="embed_tokens.weight" in names,
        has_lm_head="lm_head.weight" in names)



def eagle3_layout(arch: str) -> Layout:
    return Layout("EAGLE-3 (SpecForge)", lambda f, names, shapes: parse_eagle3_hf(f, arch, names), midlayer_name)


def eagle_layout(arch: str) -> Layout:
    return Layout("EAGLE (original)", lambda f, names, shapes: parse_eagle_hf(f, arch, names), strip_model_prefix)
