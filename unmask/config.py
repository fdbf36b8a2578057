"""Model configuration: one dataclass per checkpoint format, validated on construction.

The field names are exactly the config.json keys of the public checkpoints (docs/design.md § Checkpoints), so
a config round-trips through JSON without a translation table.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from unmask.errors import ConfigError  # noqa: F401  (re-exported)


@dataclass
class ModelConfig:
    """Architecture of a LLaDA (`llada`) or Dream (`Dream`) checkpoint.

    Dream checkpoints use Qwen2 key names (hidden_size, num_attention_heads, ...); `from_dict`
    maps them onto these fields and `to_dict` writes them back, so one dataclass serves both.
    """

    model_type: str = "llada"
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 4
    mlp_hidden_size: int = 1024
    vocab_size: int = 2048
    embedding_size: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    weight_tying: bool = False
    mask_token_id: int = 2
    eos_token_id: int = 1
    include_bias: bool = False
    # Dream (Qwen2) has biases on q/k/v only; LLaDA's include_bias applies to every linear.
    qkv_bias: bool = False
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._check_types()
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; valid: {sorted(MODEL_TYPES)}"
            )
        for name in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError("head dim (d_model / n_heads) must be even for RoPE")
        if self.embedding_size < self.vocab_size:
            raise ConfigError(
                f"embedding_size ({self.embedding_size}) must be >= vocab_size ({self.vocab_size})"
            )
        for name in ("mask_token_id", "eos_token_id"):
            tok = getattr(self, name)
            if not 0 <= tok < self.embedding_size:
                raise ConfigError(f"{name}={tok} is outside the embedding (0..{self.embedding_size - 1})")

    def _check_types(self) -> None:
        """Coerce JSON numbers to the field types; name the key when a value is not one."""
        for f in fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if kind in ("int", "float", "bool"):
                cast = {"int": int, "float": float, "bool": bool}[kind]
                ok = isinstance(value, (int, float)) and not (kind == "int" and value != int(value))
                if kind == "bool":
                    ok = isinstance(value, bool) or value in (0, 1)
                if not ok:
                    raise ConfigError(f"config key {f.name!r} must be {kind}, got {value!r}")
                setattr(self, f.name, cast(value))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    # --- JSON -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        raw = dict(raw)
        model_type = raw.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no model_type (expected 'llada' or 'Dream')")
        if model_type == "Dream":
            raw = _qwen2_to_fields(raw)
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        try:
            return cls(**known, extra=extra)
        except TypeError as e:  # wrong value types surface as TypeError in comparisons
            raise ConfigError(f"bad config value: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out.update(self.extra)
        if self.model_type == "Dream":
            return _fields_to_qwen2(out)
        out.pop("qkv_bias", None)
        # The public LLaDA modeling file reads these too; write them so our folders load there.
        out.setdefault("architectures", ["LLaDAModelLM"])
        out.setdefault("activation_type", "silu")
        out.setdefault("block_type", "llama")
        out.setdefault("rope", True)
        out.setdefault("attention_layer_norm", False)
        out.setdefault("layer_norm_type", "rms")
        out.setdefault("mlp_ratio", self.mlp_hidden_size // self.d_model or 1)
        out.setdefault("pad_token_id", self.eos_token_id)
        return out

    @classmethod
    def load(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{folder} has no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    def save(self, folder: str | Path) -> None:
        Path(folder, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


MODEL_TYPES = {"llada", "Dream"}

_QWEN2_MAP = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "num_hidden_layers": "n_layers",
    "intermediate_size": "mlp_hidden_size",
    "max_position_embeddings": "max_sequence_length",
    "tie_word_embeddings": "weight_tying",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}


def _qwen2_to_fields(raw: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in raw.items() if k not in _QWEN2_MAP}
    for src, dst in _QWEN2_MAP.items():
        if src in raw:
            out[dst] = raw[src]
    out.setdefault("embedding_size", raw.get("vocab_size"))
    out.setdefault("qkv_bias", True)
    if "mask_token_id" not in out:
        raise ConfigError("Dream config.json has no mask_token_id")
    return out


def _fields_to_qwen2(d: dict[str, Any]) -> dict[str, Any]:
    out = dict(d)
    for src, dst in _QWEN2_MAP.items():
        if dst in out:
            out[src] = out.pop(dst)
    out.pop("embedding_size", None)
    out.pop("include_bias", None)
    out.pop("qkv_bias", None)
    out.setdefault("architectures", ["DreamModel"])
    out.setdefault("hidden_act", "silu")
    return out
