"""Typed reads of draft config.json objects, and the decoder-layer fields every layout shares.

Every error is a one-line :class:`~builder.errors.DraftError` naming the file and the dotted field.
"""
from __future__ import annotations

from typing import Any, Mapping

from builder.errors import DraftError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
ACTIVATIONS = ("silu", "gelu", "relu", "relu2", "sigmoid")
LAYER_TYPES = ("llama", "qwen3")


class Fields:
    """Typed reads from one JSON object, errors naming the file and the dotted field."""

    def __init__(self, data: Mapping[str, Any], where: str, prefix: str = ""):
        self.data, self.where, self.prefix = data, where, prefix

    def fail(self, field: str, message: str) -> DraftError:
        return DraftError(f"{self.where}: field {self.prefix + field!r} {message}")

    def has(self, field: str) -> bool:
        return self.data.get(field) is not None

    def get(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def int(self, field: str, default: Any = ..., minimum: int = 1) -> Any:
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value}")
        return value

    def float(self, field: str, default: Any = ..., positive: bool = False) -> float:
        """``positive``: > 0 and finite (an epsilon, a frequency, a scale: 0 or less built a draft
        that divided by zero or proposed nothing)."""
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"must be a number, got {value!r}")
        if positive and not 0 < value < float("inf"):
            raise self.fail(field, f"must be a positive number, got {value!r}")
        return float(value)

    def str_list(self, field: str) -> tuple[str, ...]:
        value = self.data.get(field)
        if value is None:
            return ()
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self.fail(field, f"must be a list of strings, got {value!r}")
        return tuple(value)

    def bool(self, field: str, default: bool = False) -> bool:
        value = self.data.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, got {value!r}")
        return value

    def str(self, field: str, default: Any = ...) -> Any:
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, got {value!r}")
        return value

    def obj(self, field: str, required: bool = True) -> "Fields | None":
        value = self.data.get(field)
        if value is None:
            if required:
                raise self.fail(field, "is missing")
            return None
        if not isinstance(value, Mapping):
            raise self.fail(field, f"must be an object, got {type(value).__name__}")
        return Fields(value, self.where, f"{self.prefix}{field}.")

    def int_list(self, field: str) -> tuple[int, ...] | None:
        value = self.data.get(field)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(field, f"must be a non-empty list of integers, got {value!r}")
        return tuple(value)


def rope_fields(f: Fields) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    params = f.obj("rope_parameters", required=False)
    if params is not None and params.has("sliding_attention"):
        raise params.fail("sliding_attention", "(per-layer-type rope parameters) is not supported")
    theta = f.float("rope_theta", None, positive=True)
    scaling = f.obj("rope_scaling", required=False)
    source = scaling
    if params is not None:
        theta = params.float("rope_theta", theta, positive=True)
        source = params
    if theta is None:
        theta = 10000.0
    if source is None:
        return theta, None
    kind = source.get("rope_type", source.get("type", "default"))
    field = "rope_type" if source.has("rope_type") else "type"
    if kind not in ROPE_TYPES:
        raise source.fail(field, f"is {kind!r}: unsupported rope scaling (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    out = {"rope_type": kind, "factor": source.float("factor", positive=True)}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            out[key] = source.float(key, positive=True)
        out["original_max_position_embeddings"] = source.int("original_max_position_embeddings")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise source.fail("high_freq_factor", "must be greater than low_freq_factor")
    if kind == "yarn":
        out["original_max_position_embeddings"] = source.int("original_max_position_embeddings")
        out.update({key: source.float(key, positive=key.startswith("beta")) for key in _YARN_OPTIONAL
                    if source.has(key)})
        if source.has("truncate"):
            out["truncate"] = source.bool("truncate")
    return theta, tuple(sorted(out.items()))


def layer_fields(f: Fields, layer_type: str, sliding: bool = False) -> dict[str, Any]:
    """Decoder-layer fields from a Llama/Qwen3-style config object (``sliding``: the layout reads
    its sliding window itself)."""
    if layer_type not in LAYER_TYPES:
        raise f.fail("model_type", f"is {layer_type!r}: unsupported draft decoder layer "
                                   f"(supported: {', '.join(LAYER_TYPES)})")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = f.int("head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise f.fail("head_dim", f"is missing and hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    # vLLM rotates the first head_dim * partial_rotary_factor channels (so does speculators' training
    # patch); transformers' default rope ignores the factor
    params = f.obj("rope_parameters", required=False)
    factor = f.float("partial_rotary_factor", 1.0 if params is None else params.float("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if factor == 1.0 and head_dim % 2:   # rope rotates channel pairs: the head dim itself is at fault
        raise f.fail("head_dim", f"is {head_dim}: rotary embeddings need an even head dim")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise f.fail("partial_rotary_factor", f"gives rotary dim {rotary_dim} for head_dim {head_dim}")
    act = f.str("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise f.fail("hidden_act", f"is {act!r}: unsupported (supported: {', '.join(ACTIVATIONS)})")
    theta, scaling = rope_fields(f)
    if layer_type == "qwen3" and f.bool("use_sliding_window") and not sliding:
        raise f.fail("use_sliding_window", "is true: sliding-window draft attention is not supported")
    return dict(
        layer_type=layer_type, hidden_size=hidden, intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers", 1), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=f.float("rms_norm_eps", 1e-6, positive=True),
        hidden_act=act, rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim,
        attention_bias=f.bool("attention_bias"), mlp_bias=f.bool("mlp_bias"),
        max_position_embeddings=f.int("max_position_embeddings", None))


def verifier_fields(f: Fields) -> dict[str, Any]:
    spec = f.obj("speculators_config", required=False)
    verifier = None if spec is None else spec.obj("verifier", required=False)
    if verifier is None:
        return {}
    return dict(verifier=verifier.get("name_or_path"), verifier_architectures=verifier.str_list("architectures"))


def aux_layer_ids(f: Fields) -> tuple[int, ...] | None:
    ids = f.int_list("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        eagle = f.obj("eagle_config", required=False)
        if eagle is not None:
            ids = eagle.int_list("eagle_aux_hidden_state_layer_ids")
    return ids



def proposal_tokens(f: Fields) -> int | None:
    spec = f.obj("speculators_config", required=False)
    if spec is None:
        return None
    methods = spec.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not isinstance(methods[0], Mapping):
        return None
    value = methods[0].get("speculative_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None



# --- DFlash / DSpark fields (speculators and z-lab spell them alike) ----------------------------
#: speculators' Markov head types; only ``vanilla`` (B = W2(W1[prev])) is implemented
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def refuse_sliding(f: Fields, dflash: "Fields | None") -> None:
    types = f.get("layer_types")
    if isinstance(types, list) and any(t != "full_attention" for t in types):
        bad = next(t for t in types if t != "full_attention")
        raise f.fail("layer_types", f"has {bad!r}: only full-attention DFlash layers are supported "
                                    f"(sliding-window / causal block attention is not)")
    if dflash is not None:
        if dflash.get("use_swa"):
            raise dflash.fail("use_swa", "is true: sliding-window DFlash attention is not supported")
        if dflash.get("causal"):
            raise dflash.fail("causal", "is true: causal DFlash block attention is not supported")
        if dflash.get("attention_sink_bias"):
            raise dflash.fail("attention_sink_bias", "is true: attention sinks are not supported")
    if f.get("add_swa_attention_sink_bias"):
        raise f.fail("add_swa_attention_sink_bias", "is true: attention sinks are not supported")
    if f.get("is_causal"):
        raise f.fail("is_causal", "is true: causal DFlash block attention is not supported")



def markov_fields(f: Fields, kind: str, names: set[str]) -> dict[str, Any]:
    if kind != "dspark":
        return {}
    rank = f.int("markov_rank", None, minimum=0)
    if rank is None:  # HF layouts may omit it: read it off W1
        rank = 0
    head = f.str("markov_head_type", "vanilla")
    if head not in MARKOV_HEAD_TYPES:
        raise f.fail("markov_head_type", f"is {head!r}: unknown Markov head type (speculators defines "
                                         f"{', '.join(MARKOV_HEAD_TYPES)})")
    if head != "vanilla":
        raise f.fail("markov_head_type", f"is {head!r}: only the vanilla Markov head (B = W2(W1[prev])) "
                                         f"is supported")
    confidence = f.bool("enable_confidence_head", "confidence_head.proj.weight" in names)
    with_markov = f.bool("confidence_head_with_markov", confidence and rank > 0)
    return dict(markov_rank=rank, markov_head_type=head, confidence_head=confidence,
                confidence_head_with_markov=with_markov and confidence)

