"""Model configuration: one dataclass for every checkpoint format, validated on construction.

The field names are LLaDA's config.json keys. Each family's format module (unmask/formats/) says
how its config.json maps onto them (a `JsonKeys`): which keys are renamed (Dream's and SDAR's Qwen
names), which keys name an architecture variant unmask builds only one value of, and which keys do
not change inference.
Every key of a config.json is one of those or a field; any other key is refused, so nothing a
checkpoint asks for is silently ignored. (`dtype`, transformers 5's name for `torch_dtype`, is read
as that field.)
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from unmask.errors import ConfigError  # noqa: F401  (re-exported)
from unmask.formats import FORMATS
from unmask.formats.keys import MOE_FIELDS, JsonKeys, show

MODEL_TYPES = tuple(FORMATS)
# The block-diffusion families: block-causal, their config names (or fixes) the trained block size.
BLOCK_TYPES = ("sdar", "llada2_moe", "Fast_dLLM_Qwen")
# Fields only some families' config.json has a key for; the others leave them None.
FAMILY_FIELDS = ("head_size", "block_size", *MOE_FIELDS)
# The Qwen2-layout families, whose q/k/v projections carry biases.
QKV_BIASED = ("Dream", "Fast_dLLM_Qwen")
# The dtypes a checkpoint can run in; the names are config.json's torch_dtype values.
TORCH_DTYPES = ("float32", "bfloat16", "float16")
# Sanity bounds, orders of magnitude above any published model (LLaDA-8B: d_model 4096, 32 layers,
# vocab 126,464). Past them even the empty (meta-device) model overflows torch's sizes or takes
# hours to build, so a typo such as 10**12 is refused before anything is built.
MAX_WIDTH = 1 << 20  # d_model, mlp_hidden_size, vocab_size, embedding_size, head counts
MAX_LAYERS = 1 << 12
# max_sequence_length sizes no weight, but the engine sizes arrays by the canvas it allows:
# 10**30 was accepted, and a gen_length past memory then died in numpy, not with a length error.
# Published models use <= 131,072; `unmask train` names the memory of --max-seq-len up to here.
MAX_POSITIONS = 1 << 28
# Keys a config.json must set: the reference fills absent ones with its own defaults (OLMo's,
# Qwen2's), not ours, so an absent key would silently build a model the reference does not.
# Absent LLaDA n_kv_heads / mlp_hidden_size are derived by the model file's `prepare`.
REQUIRED = ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
            "mask_token_id", "eos_token_id", "head_size", "block_size", *MOE_FIELDS)


@dataclass
class ModelConfig:
    """Architecture of a LLaDA (`llada`), Dream (`Dream`), SDAR (`sdar`), LLaDA2 (`llada2_moe`)
    or Fast-dLLM v2 (`Fast_dLLM_Qwen`) checkpoint.

    Fields left None take the model type's reference value in `__post_init__`.
    """

    model_type: str = "llada"
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 4
    mlp_hidden_size: int = 1024
    vocab_size: int = 2048
    # Rows of the embedding (LLaDA pads it past vocab_size); None: vocab_size, as in LLaDA.
    embedding_size: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    weight_tying: bool = False
    mask_token_id: int = 2
    eos_token_id: int = 1
    # LLaDA's include_bias puts biases on every linear, the LM head and the norms; only false
    # is built (kept as a field because LLaDA configs always carry it).
    include_bias: bool = False
    # Biases on q/k/v only: LLaDA's include_qkv_bias (default false); Dream (Qwen2) always has them.
    qkv_bias: bool | None = None
    # Rotate q/k in float32 and cast back (LLaDA's rope_full_precision, default true in its
    # configuration file); Dream (Qwen2) rotates in the model's dtype.
    rope_full_precision: bool | None = None
    # Dream (Qwen2) and SDAR: None, or {"type" (or "rope_type"): "linear" | "default", "factor": f}.
    rope_scaling: dict[str, Any] | None = None
    # Width of one attention head where the format sets it apart from d_model / n_heads (SDAR's
    # head_dim: 128 with hidden_size 2560 and 32 heads in SDAR-4B); None: d_model / n_heads.
    head_size: int | None = None
    # Block-diffusion families only (SDAR): the block size the model was trained with. Attention
    # is block-causal: a position sees its own block and every earlier one (docs/design.md § Checkpoints).
    # None: bidirectional (LLaDA, Dream).
    block_size: int | None = None
    # LLaDA2 only (docs/design.md § Checkpoints): routed experts per MoE layer, how many a token
    # uses, always-on shared experts, an expert's MLP width, the expert groups and how many of
    # them a token may draw from, the factor on the routed sum, the leading dense layers, and the
    # share of each head's width that RoPE rotates.
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    num_shared_experts: int | None = None
    moe_intermediate_size: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    first_k_dense_replace: int | None = None
    partial_rotary_factor: float | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; valid: {sorted(MODEL_TYPES)}"
            )
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        if self.qkv_bias is None:
            self.qkv_bias = self.model_type in QKV_BIASED
        if self.rope_full_precision is None:
            self.rope_full_precision = self.model_type == "llada"
        self._check_extra()
        self._check_types()
        self._check_sizes()
        self._check_choices()
        if self.model_type == "llada2_moe":
            self._check_experts()
        if self.model_type == "sdar" and self.head_size is None:
            # written to config.json: SDAR's configuration reads head_dim, and null is no width
            self.head_size = self.head_dim

    def _check_types(self) -> None:
        """Coerce JSON numbers to the field types; name the key when a value is not one."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type).removesuffix(" | None")
            if value is None and kind != str(f.type):  # an optional field left unset
                continue
            if kind in ("int", "float", "bool"):
                if kind == "bool":
                    ok = isinstance(value, bool) or value in (0, 1)
                else:  # true/false are not sizes; NaN and 1e999 (inf) are not numbers
                    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                          and math.isfinite(value) and not (kind == "int" and value != int(value)))
                if not ok:
                    raise ConfigError(f"config key {self._key(f.name)!r} must be {kind}, got {value!r}")
                setattr(self, f.name, {"int": int, "float": float, "bool": bool}[kind](value))

    def _check_sizes(self) -> None:
        k = self._key
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            value = getattr(self, name)
            limit = {"n_layers": MAX_LAYERS, "max_sequence_length": MAX_POSITIONS}.get(name, MAX_WIDTH)
            if not 0 < value <= limit:
                raise ConfigError(f"{k(name)} must be an integer in 1..{limit:,}, got {value:,}")
        for name in ("rope_theta", "rms_norm_eps"):
            if getattr(self, name) <= 0:  # a non-positive base or epsilon gives NaN activations
                raise ConfigError(f"{name} must be a positive number, got {getattr(self, name)}")
        for name in ("head_size", "block_size", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= MAX_WIDTH:
                raise ConfigError(f"{k(name)} must be an integer in 1..{MAX_WIDTH:,}, got {value:,}")
        if self.head_size is None and self.d_model % self.n_heads:
            raise ConfigError(f"{k('d_model')} ({self.d_model}) must be divisible by "
                              f"{k('n_heads')} ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{k('n_heads')} ({self.n_heads}) must be divisible by "
                              f"{k('n_kv_heads')} ({self.n_kv_heads})")
        if self.head_dim % 2:
            what = k("head_size") if self.head_size else f"{k('d_model')} / {k('n_heads')}"
            raise ConfigError(f"head dim ({what}) must be even for RoPE, got {self.head_dim}")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(
                f"embedding_size ({self.embedding_size}) must be >= vocab_size ({self.vocab_size})"
            )
        for name in ("mask_token_id", "eos_token_id"):
            tok = getattr(self, name)
            if not 0 <= tok < self.embedding_size:
                raise ConfigError(f"{name}={tok} is outside the embedding (0..{self.embedding_size - 1})")
        if self.mask_token_id == self.eos_token_id:
            raise ConfigError(f"mask_token_id and eos_token_id are both {self.eos_token_id}; the "
                              "mask must be a token of its own")
        if self.eos_token_id >= self.vocab_size:
            raise ConfigError(f"eos_token_id={self.eos_token_id} is not in the vocabulary "
                              f"(0..{self.vocab_size - 1}): the model could never predict it")

    def _check_choices(self) -> None:
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(f"config key 'torch_dtype' = {show(self.torch_dtype)} is not supported; "
                              f"valid: {', '.join(TORCH_DTYPES)}")
        if self.include_bias:
            raise ConfigError("config key 'include_bias' = true (biases on every linear, the LM "
                              "head and the norms) is not supported; unmask builds false")
        keys = json_keys(self.model_type)
        # Fields only some families' config.json has a key for: set on another, a save would
        # drop them.
        stray = [f for f in FAMILY_FIELDS if f in keys.omitted and getattr(self, f) is not None]
        if stray:
            raise ConfigError(f"{', '.join(stray)}: no key of model_type {self.model_type}'s "
                              "config.json sets these; leave them unset")
        if self.model_type in BLOCK_TYPES and self.block_size is None:
            raise ConfigError(f"{self.model_type} is a block-diffusion model: config key "
                              f"{self._key('block_size')!r} (the block size it was trained with) "
                              "must be set")
        if self.model_type == "llada":
            if self.rope_scaling is not None:
                raise ConfigError(f"config key 'rope_scaling' = {show(self.rope_scaling)} is not "
                                  "a LLaDA key; unmask builds LLaDA without RoPE scaling")
            return
        name = self.model_type
        biased = self.model_type in QKV_BIASED
        if self.qkv_bias != biased:
            raise ConfigError(f"{name} {'always' if biased else 'never'} has q/k/v biases; "
                              f"qkv_bias={self.qkv_bias} is not a {name} model")
        if self.rope_full_precision:
            raise ConfigError(f"rope_full_precision is a LLaDA key; {name} rotates q/k in the "
                              "model dtype")
        if self.embedding_size != self.vocab_size:
            raise ConfigError(f"{name}'s embedding has vocab_size ({self.vocab_size}) rows; "
                              f"embedding_size={self.embedding_size} cannot be written in its config")
        self.rope_factor()  # validates rope_scaling

    def _check_experts(self) -> None:
        """The MoE keys against each other, as the reference's routing needs them: experts split
        evenly into groups of at least two (a group scores by its two best experts), no more
        groups or experts drawn than exist, dense layers within the model."""
        missing = [f for f in MOE_FIELDS if getattr(self, f) is None]
        if missing:
            raise ConfigError(f"{self.model_type} is a mixture of experts: config keys "
                              f"{', '.join(missing)} must be set")
        k, e, g = self._key, self.num_experts, self.n_group
        if e % g:
            raise ConfigError(f"config key 'num_experts' ({e}) must be divisible by 'n_group' ({g})")
        if e // g < 2:
            raise ConfigError(f"config key 'n_group' ({g}) leaves {e // g} expert per group; a "
                              "group is scored by its two best experts, so it needs at least 2")
        if self.topk_group > g:
            raise ConfigError(f"config key 'topk_group' ({self.topk_group}) is above 'n_group' ({g})")
        if self.num_experts_per_tok > self.topk_group * (e // g):
            raise ConfigError(f"config key 'num_experts_per_tok' ({self.num_experts_per_tok}) is "
                              f"above the {self.topk_group * (e // g)} experts of the 'topk_group' "
                              f"({self.topk_group}) groups a token may use (num_experts {e})")
        if not 0 <= self.first_k_dense_replace <= self.n_layers:
            raise ConfigError(f"config key 'first_k_dense_replace' ({self.first_k_dense_replace}) "
                              f"must be in 0..{k('n_layers')} ({self.n_layers})")
        if self.num_shared_experts < 0:
            raise ConfigError(f"config key 'num_shared_experts' must be >= 0, got "
                              f"{self.num_shared_experts}")
        if not 0 < self.routed_scaling_factor < math.inf:
            raise ConfigError(f"config key 'routed_scaling_factor' must be a positive number, got "
                              f"{self.routed_scaling_factor}")
        rotated = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotated < 2 or rotated % 2:
            raise ConfigError(f"config key 'partial_rotary_factor' ({self.partial_rotary_factor}) "
                              f"must rotate an even width in 2..{k('head_size')} ({self.head_dim}) "
                              f"of each head, got {rotated}")

    @property
    def rotary_dim(self) -> int:
        """The leading width of each head that RoPE rotates (LLaDA2: head_dim *
        partial_rotary_factor, truncated as its modeling code does); the whole head otherwise."""
        if self.partial_rotary_factor is None:
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def _key(self, name: str) -> str:
        """The config.json key of field `name`: errors name the key as the file spells it."""
        renamed = json_keys(self.model_type).renamed if self.model_type in MODEL_TYPES else {}
        return next((key for key, f in renamed.items() if f == name), name)

    def _check_extra(self) -> None:
        keys = json_keys(self.model_type)
        for key, value in self.extra.items():
            if key in keys.variants:
                allowed, what = keys.variants[key]
                if not any(value == a and type(value) is type(a) or value is a for a in allowed):
                    raise ConfigError(
                        f"config key {key!r} = {show(value)} ({what}) is not supported; unmask "
                        f"builds {key} = {' or '.join(show(a) for a in allowed)}")
            elif key not in keys.inert:
                raise ConfigError(
                    f"config key {key!r} = {show(value)} is not one unmask knows for model_type "
                    f"{self.model_type}; refused rather than ignored (docs/checkpoints.md)")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    def rope_factor(self) -> float:
        """The linear RoPE scaling factor (positions are divided by it); 1.0 without scaling."""
        s = self.rope_scaling
        if s is None:
            return 1.0
        kind = s.get("rope_type", s.get("type")) if isinstance(s, dict) else None
        # no default factor: transformers refuses linear scaling without one, and a silent 1.0
        # would run a model meant for scaled positions unscaled
        factor = s.get("factor") if isinstance(s, dict) else None
        if kind == "default":
            return 1.0
        if kind != "linear" or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not 0 < factor < math.inf:
            raise ConfigError(f"config key 'rope_scaling' = {show(s)} is not supported; unmask "
                              "builds null, default, or linear with a positive factor (written)")
        return float(factor)

    # --- JSON -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError(f"config.json has no model_type (expected one of {sorted(MODEL_TYPES)})")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; valid: {sorted(MODEL_TYPES)}")
        keys = json_keys(model_type)
        raw = _dtype_alias(dict(raw))
        raw = keys.prepare(raw) if keys.prepare else raw
        to_field = keys.json_fields(FIELD_NAMES)
        required = [k for k, f in to_field.items() if f in REQUIRED]
        absent = [k for k in required if k not in raw]
        if absent:
            raise ConfigError(f"config.json has no {', '.join(map(repr, absent))}; model_type "
                              f"{model_type} needs each of {', '.join(required)}")
        known = {**keys.fixed, **{to_field[k]: v for k, v in raw.items() if k in to_field}}
        extra = {k: v for k, v in raw.items() if k not in to_field}
        try:
            return cls(**known, extra=extra)
        except TypeError as e:  # wrong value types surface as TypeError in comparisons
            raise ConfigError(f"bad config value: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The config.json of this config's format: fields under their JSON names, every
        variant key at the value built, and the inert keys it was loaded with."""
        keys = json_keys(self.model_type)
        values = asdict(self)
        out = {k: values[f] for k, f in keys.json_fields(FIELD_NAMES).items()}
        out.update({k: allowed[0] for k, (allowed, _) in keys.variants.items()
                    if k not in keys.implied})
        out.update(keys.written)
        out.update(self.extra)
        return out

    @classmethod
    def load(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} has no config.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path} cannot be read: {e}") from e
        # ValueError: bad JSON or bad UTF-8; RecursionError: absurdly deep nesting
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(raw)
        except ConfigError as e:  # every message of load names the folder, once
            raise ConfigError(f"{folder}: {e}") from e

    def save(self, folder: str | Path) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def json_keys(model_type: str) -> JsonKeys:
    """The config.json mapping of `model_type` (unmask/formats/)."""
    return FORMATS[model_type]


# ModelConfig's fields, in order: what a format's keys map onto.
FIELD_NAMES = tuple(f.name for f in fields(ModelConfig))


def _dtype_alias(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes the run dtype as `dtype`, 4.x as `torch_dtype`: read either (saved
    back as torch_dtype, which 5 still reads); both must agree."""
    if "dtype" not in raw:
        return raw
    value = raw.pop("dtype")
    if "torch_dtype" in raw and raw["torch_dtype"] != value:
        raise ConfigError(f"config keys 'dtype' = {show(value)} and 'torch_dtype' = "
                          f"{show(raw['torch_dtype'])} disagree; they name the same setting")
    if value not in TORCH_DTYPES:
        raise ConfigError(f"config key 'dtype' = {show(value)} is not supported; "
                          f"valid: {', '.join(TORCH_DTYPES)}")
    raw["torch_dtype"] = value
    return raw


