"""EagleMistralForCausalLM (vLLM ``mistral_eagle.py``) in its Hugging Face and Mistral native layouts,
onto the EAGLE module (:class:`builder.models.eagle.EagleDraft`).

The draft: ``fc`` = Linear(2H -> H, no bias) over ``concat(embedding, hidden)`` (embedding first),
ordinary Mistral (= Llama) decoder layers, layer 0 keeping its ``input_layernorm``, a final ``norm``
whose output is both the LM head's input and the hidden recycled at the next step; the target's
embedding and LM head (a copy the checkpoint may carry is not used, as in vLLM).

* Hugging Face: ``config.json`` with ``architectures: ["EagleMistralForCausalLM"]`` (``model_type``
  mistral; ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta`` / ``rope_parameters``,
  ``vocab_size``, ``sliding_window`` null); tensors ``model.fc.weight``, ``model.norm.weight``,
  ``model.layers.N.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.N.mlp.{gate,up,down}_proj.weight``,
  ``model.layers.N.{input,post_attention}_layernorm.weight``.
* Mistral native: ``params.json`` (``dim``, ``n_layers``, ``head_dim``, ``hidden_dim``, ``n_heads``,
  ``n_kv_heads``, ``norm_eps``, ``vocab_size``, ``rope_theta``) + ``consolidated.safetensors``:
  ``eagle_linear`` = fc, ``layers.N.attention.{wq,wk,wv,wo}``, ``layers.N.feed_forward.{w1,w2,w3}``
  (gate, down, up), ``layers.N.attention_norm``, ``layers.N.ffn_norm``, ``norm`` (each ``.weight``).
  Mistral keeps the rows of ``wq`` / ``wk`` in interleaved (GPT-J) RoPE order: channel pairs
  (2j, 2j+1) of a head rotate together. Our RoPE rotates halves (j, j + D/2), so those rows are
  permuted once at load. ``sliding_window``, ``yarn``, ``quantization`` and ``moe`` are refused.
"""
from __future__ import annotations

import re
from pathlib import Path

from builder.errors import DraftError
from builder.formats.fields import Fields, layer_fields
from builder.formats.reader import Layout, read_json, strip_model_prefix
from builder.models.draft_configs import EagleConfig

ARCHITECTURE = "EagleMistralForCausalLM"
PARAMS_FILE = "params.json"
CONSOLIDATED = "consolidated.safetensors"
#: params.json key -> the Hugging Face key it stands for
PARAMS_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
               "n_kv_heads": "num_key_value_heads", "hidden_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
               "head_dim": "head_dim", "rope_theta": "rope_theta", "vocab_size": "vocab_size",
               "max_position_embeddings": "max_position_embeddings"}
_UNSUPPORTED = ("sliding_window", "yarn", "quantization", "moe", "lora")
#: the target's embedding and LM head are used; copies in the checkpoint are not read
_SHARED = ("embed_tokens.weight", "lm_head.weight")


def _config(f: Fields, source: str) -> EagleConfig:
    for key in _UNSUPPORTED:
        if f.get(key):
            raise f.fail(key, f"is {f.get(key)!r}: not supported for an EagleMistral draft")
    return EagleConfig(
        source=source, architecture=ARCHITECTURE, **layer_fields(f, "llama"), vocab_size=f.int("vocab_size"),
        fc_bias=False, embedding_norm=False, first_input_norm=True, final_norm=True, norm_hidden_out=True,
        has_embedding=False, has_lm_head=False)


# --- Hugging Face ---------------------------------------------------------------------------------
HF_LAYOUT = Layout("EagleMistral (Hugging Face)", lambda f, names, shapes: _config(f, "mistral_hf"),
                   strip_model_prefix, ignored=_SHARED, stored=lambda name: "model." + name)


# --- Mistral native -------------------------------------------------------------------------------
class _Params(Fields):
    """params.json read through Hugging Face key names; errors name the params.json key."""

    def __init__(self, data: dict, where: str):
        hf = {PARAMS_KEYS[k]: v for k, v in data.items() if k in PARAMS_KEYS}
        hf.update({k: v for k, v in data.items() if k in _UNSUPPORTED})
        super().__init__(hf, where)
        self.native = {v: k for k, v in PARAMS_KEYS.items()}

    def fail(self, field: str, message: str) -> DraftError:
        return DraftError(f"{self.where}: field {self.native.get(field, field)!r} {message}")


#: consolidated.safetensors module names -> canonical ones, inside ``layers.N.`` and at the top
_LAYER_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
                "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"eagle_linear": "fc", "norm": "norm", "tok_embeddings": "embed_tokens", "output": "lm_head"}


def _rename(name: str, layer: dict, top: dict) -> str:
    m = re.match(r"(layers\.\d+\.)(.+)\.([^.]+)$", name)
    if m and m.group(2) in layer:
        return f"{m.group(1)}{layer[m.group(2)]}.{m.group(3)}"
    module, _, leaf = name.rpartition(".")
    return f"{top[module]}.{leaf}" if module in top else name


def native_name(stored: str) -> str:
    """A consolidated.safetensors name -> its canonical name (unknown names stay as they are)."""
    return _rename(stored, _LAYER_NAMES, _TOP_NAMES)


def stored_native_name(name: str) -> str:
    """A canonical name -> the consolidated.safetensors name that holds it."""
    return _rename(name, {v: k for k, v in _LAYER_NAMES.items()}, {v: k for k, v in _TOP_NAMES.items()})


def interleaved_to_half(w, heads: int):
    """Rows of a q/k projection from interleaved RoPE order (pairs 2j, 2j+1 of each head) to
    rotate-half order (j, j + D/2)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w, heads: int):
    """The inverse of :func:`interleaved_to_half` (how Mistral stores an HF q/k projection)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_order(cfg: EagleConfig, weights: dict) -> dict:
    out = dict(weights)
    for i in range(cfg.num_hidden_layers):
        for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
            name = f"layers.{i}.self_attn.{proj}_proj.weight"
            out[name] = interleaved_to_half(out[name], heads).contiguous()
    return out


def _files(directory: Path) -> list[Path]:
    path = directory / CONSOLIDATED
    if not path.is_file():
        raise DraftError(f"{path}: missing; a Mistral native draft ({PARAMS_FILE}) keeps its tensors there")
    return [path]


NATIVE_LAYOUT = Layout("EagleMistral (Mistral native)", lambda f, names, shapes: _config(f, "mistral_native"),
                       native_name, convert=_rope_order, config_file=PARAMS_FILE, files=_files,
                       stored=stored_native_name, ignored=_SHARED, fields=_Params)


def is_native(directory: Path) -> bool:
    """A Mistral native draft: params.json and no config.json."""
    return (directory / PARAMS_FILE).is_file() and not (directory / "config.json").is_file()


def read_params(directory: Path) -> tuple[dict, str]:
    return read_json(directory / PARAMS_FILE, PARAMS_FILE)
