"""The z-lab / DeepSpec DFlash and DSpark layout the serving engines read, from ``architectures``.

``DFlashDraftModel`` / ``DFlashQwen3ForCausalLM`` / ``Qwen3DSparkModel`` / ``DSparkDraftModel``:
Qwen3 fields at the top level; ``block_size`` at the top level or in ``dflash_config``; target layer
ids in ``dflash_config.target_layer_ids``, ``dspark_target_layer_ids`` or ``target_layer_ids`` in
z-lab's convention (id i = the OUTPUT of target layer i = HF ``hidden_states[i + 1]``; we add 1, as
vLLM's ``get_eagle3_aux_layers_from_config`` and speculators' DFlash converter do), or
``eagle_aux_hidden_state_layer_ids`` (HF convention, used as is); ``mask_token_id`` in
``dflash_config`` or at the top level (or ``dspark_noise_token_id``). The draft may ship its own
``embed_tokens.weight`` and ``lm_head.weight``; fused ``qkv_proj`` / ``gate_up_proj`` tensors are
split; a ``model.`` prefix is dropped; the d2t map may be named ``draft_id_to_target_id``. Sliding
window layers, causal-block overrides and attention sinks (``dflash_config.use_swa``, ``causal``,
``attention_sink_bias``, ``layer_types``) are refused with an error naming the field.
"""
from __future__ import annotations

from builder.errors import DraftError
from builder.formats.fields import Fields, layer_fields, markov_fields, refuse_sliding
from builder.formats.reader import Layout, strip_model_prefix
from builder.formats.tensors import Shape, fmt
from builder.models.draft_configs import DFlashConfig, DSparkConfig

DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlashQwen3ForCausalLM", "DFlashSpeculator")
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")
ARCHITECTURES = DFLASH_ARCHITECTURES + DSPARK_ARCHITECTURES


def parse_dflash(f: Fields, arch: str, names: set[str], shapes: dict[str, Shape]) -> DFlashConfig:
    dflash = f.obj("dflash_config", required=False)
    refuse_sliding(f, dflash)
    kind = "dspark" if arch in DSPARK_ARCHITECTURES or "markov_head.markov_w1.weight" in names else "dflash"
    layers = layer_fields(f, f.str("model_type", "qwen3"))
    target_vocab = f.int("vocab_size")
    ids, ids_field, offset = None, "", 0
    for holder, field in ((dflash, "target_layer_ids"), (f, "dspark_target_layer_ids"), (f, "target_layer_ids")):
        if holder is not None and holder.int_list(field) is not None:
            ids = tuple(i + 1 for i in holder.int_list(field))  # z-lab: output of layer i
            ids_field, offset = holder.prefix + field, 1
            break
    if ids is None:
        ids, ids_field = f.int_list("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        raise f.fail("dflash_config.target_layer_ids", "is missing: a DFlash draft names the target layers it reads")
    mask = None if dflash is None else dflash.int("mask_token_id", None, minimum=0)
    for field in ("mask_token_id", "dspark_noise_token_id"):
        if mask is None:
            mask = f.int(field, None, minimum=0)
    if mask is None:
        raise f.fail("dflash_config.mask_token_id", "is missing: DFlash block rows after the anchor embed the mask token")
    block = f.int("block_size", None)
    if block is None and dflash is not None:
        block = dflash.int("block_size", None)
    extra = markov_fields(f, kind, names)
    if kind == "dspark" and extra["markov_rank"] == 0:
        w1 = shapes.get("markov_head.markov_w1.weight")
        extra["markov_rank"] = w1[1] if w1 is not None and len(w1) == 2 else 0
        if extra["confidence_head"] and "confidence_head_with_markov" not in f.data:
            extra["confidence_head_with_markov"] = extra["markov_rank"] > 0
    emb = shapes.get("embed_tokens.weight")
    cls = DSparkConfig if kind == "dspark" else DFlashConfig
    return cls(
        source="zlab", architecture=arch, **layers,
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        target_layer_ids=ids, block_size=block or 16, mask_token_id=mask,
        sample_from_anchor=f.bool("sample_from_anchor", kind == "dspark"),
        num_speculative_tokens=None, embedding_rows=emb[0] if emb is not None and len(emb) == 2 else 0,
        has_lm_head="lm_head.weight" in names, has_d2t="d2t" in names, layer_ids_field=ids_field,
        layer_ids_offset=offset, **extra)



def canonical(stored: str) -> str:
    name = strip_model_prefix(stored)
    return "d2t" if name == "draft_id_to_target_id" else name


_PACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_ROW_SUFFIXES = ("weight", "bias", "weight_scale")       # split along the output rows
_SHARED_SUFFIXES = ("weight_scale_2", "input_scale")    # per-tensor scalars: each part keeps them


def unpack(entries: dict, data: dict) -> dict:
    """Expand fused ``qkv_proj`` / ``gate_up_proj`` entries into one virtual entry per projection
    (sizes from the config: q heads, kv heads, head_dim, intermediate_size). NVFP4 packed weights
    and their block scales split along the rows too; their global scales are shared."""
    hidden = data.get("hidden_size")
    heads, kv_heads = data.get("num_attention_heads"), data.get("num_key_value_heads", data.get("num_attention_heads"))
    head_dim = data.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                        and heads > 0 else None)   # else the fields' checks name it
    out = {}
    for name, entry in entries.items():
        fused = next((k for k in _PACKED if f".{k}." in f".{name}"), None)
        suffix = name.rsplit(".", 1)[-1]
        if fused is None or suffix not in _ROW_SUFFIXES + _SHARED_SUFFIXES:
            out[name] = entry
            continue
        path, stored, shape, dtype, _ = entry
        if suffix in _SHARED_SUFFIXES:
            for part in _PACKED[fused]:
                out[name.replace(fused, part)] = entry
            continue
        if fused == "self_attn.qkv_proj":
            if not all(isinstance(v, int) for v in (heads, kv_heads, head_dim)):
                raise DraftError(f"{path}: tensor {stored!r} is a fused qkv projection but config.json lacks "
                                 f"num_attention_heads / num_key_value_heads / head_dim to split it")
            sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        else:
            inter = data.get("intermediate_size")
            if not isinstance(inter, int):
                raise DraftError(f"{path}: tensor {stored!r} is a fused gate/up projection but config.json "
                                 f"lacks intermediate_size to split it")
            sizes = [inter, inter]
        if not shape or shape[0] != sum(sizes):
            raise DraftError(f"{path}: tensor {stored!r} has shape {fmt(shape)}, expected {sum(sizes)} rows "
                             f"({' + '.join(map(str, sizes))}) for the fused projection")
        start = 0
        for part, size in zip(_PACKED[fused], sizes):
            out[name.replace(fused, part)] = (path, stored, (size,) + tuple(shape[1:]), dtype, (start, size))
            start += size
    return out


def layout(arch: str) -> Layout:
    return Layout("z-lab DFlash", lambda f, names, shapes: parse_dflash(f, arch, names, shapes), canonical, unpack)
