"""The text model's shape, read from a Hugging Face Qwen3.5 `config.json`.

Knows both layouts: `qwen3_5` (Qwen3_5ForConditionalGeneration: text settings under `text_config`, text weights
under `model.language_model.`) and `qwen3_5_text` (Qwen3_5ForCausalLM: settings at the top, weights under
`model.`). Knows nothing of tensors, devices or weights: it only reads JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LINEAR = "linear_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    """The checkpoint folder is not a Qwen3.5 checkpoint this project can load."""


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    weight_prefix: str  # where the text model's weights live in the safetensors files
    # multimodal rotary (image rows): frequencies of the height / width sections, interleaved as transformers does
    mrope_section: tuple[int, ...] = (11, 11, 10)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:  # GDN: all key heads together
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # GDN: all value heads together
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # GDN: the channels the short convolution runs over (q, k, v)
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]


def _text_settings(raw: dict) -> tuple[dict, str, bool]:
    kind = raw.get("model_type")
    if kind == "qwen3_5":
        text = dict(raw.get("text_config") or {})
        tie = bool(raw.get("tie_word_embeddings", False))  # transformers ties by the top-level flag, not text_config's
        return text, "model.language_model.", tie
    if kind == "qwen3_5_text":
        return raw, "model.", bool(raw.get("tie_word_embeddings", False))
    raise ConfigError(f"model_type {kind!r} is not a Qwen3.5 checkpoint (want 'qwen3_5' or 'qwen3_5_text')")


def parse_config(raw: dict) -> TextConfig:
    text, prefix, tie = _text_settings(raw)
    try:
        n = int(text["num_hidden_layers"])
        types = text.get("layer_types")
        if types is None:
            every = int(text.get("full_attention_interval", 4))
            types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
        types = tuple(types[:n])
        bad = sorted(set(types) - {LINEAR, FULL})
        if bad:
            raise ConfigError(f"unknown layer types {bad}")
        if text.get("attention_bias"):
            raise ConfigError("attention_bias is true: this loader has no attention biases (Qwen3.5 has none)")
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (Qwen3.5 uses 'silu')")
        rope = dict(text.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        heads = int(text["num_attention_heads"])
        return TextConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            layer_types=types,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            tie_word_embeddings=tie,
            weight_prefix=prefix,
            mrope_section=tuple(int(x) for x in rope.get("mrope_section") or (11, 11, 10)),
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None


def load_config(model_dir: str | Path) -> TextConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: STATECACHE_MODEL / --model must name a Hugging Face checkpoint folder")
    return parse_config(json.loads(path.read_text()))
