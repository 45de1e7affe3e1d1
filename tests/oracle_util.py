"""Tiny random Qwen3.5 checkpoints (made by transformers, every parameter perturbed) and transformers' own answers.

The oracle for statecache's forward: the checkpoint is loaded back with transformers' ``Qwen3_5ForCausalLM`` /
``Qwen3_5ForConditionalGeneration`` (through ``statecache.dev.checkpoints``, so fla is hidden and transformers takes its
torch path) and an answer is the softmax of its full logits at a slot, restricted to the first ``nopts`` option
letters (the row contract: docs/ROWS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from statecache.dev.checkpoints import load_reference, make_checkpoint

VOCAB = 300
# 26 distinct option-letter ids below VOCAB, deliberately not in increasing order (a head-row mix-up shows)
LETTERS = [(7 + 37 * i) % VOCAB for i in range(26)]
assert len(set(LETTERS)) == 26

LIN, FULL = "linear_attention", "full_attention"


def _rope(factor: float, theta: float = 10_000.0, mrope: list[int] | None = None) -> dict:
    r = dict(rope_type="default", rope_theta=theta, partial_rotary_factor=factor)
    if mrope is not None:
        r.update(mrope_section=mrope, mrope_interleaved=True)
    return r


# name -> (layout, max_shard_bytes, Qwen3_5TextConfig fields). Each varies GQA ratio (Hq:Hkv), linear value:key
# heads (Hv:Hk), head dims (linear Dk != Dv in some), tied/untied, partial rotary and mrope fields; every one has
# at least one full-attention layer, from layer_types or from the default interval pattern (every 4th layer).
CONFIGS: dict[str, tuple[str, int | None, dict]] = {
    # the default pattern (layer 3 full), GQA 2, GVA 2, Dk 8 != Dv 16, rotary 0.25 with an mrope section
    "causal_untied_gqa2": ("causal", None, dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=16, tie_word_embeddings=False, rope_parameters=_rope(0.25, mrope=[1, 1, 0]))),
    # sharded, tied, full attention first, MHA (GQA 1), GVA 4, Dk 16 != Dv 8, rotary 0.5, no mrope fields
    "causal_tied_sharded": ("causal", 20_000, dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=5, layer_types=[FULL, LIN, LIN, FULL, LIN],
        num_attention_heads=3, num_key_value_heads=3, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters=_rope(0.5, theta=1_000_000.0))),
    # conv kernel 3, GQA 3, no GVA, full rotary 1.0
    "causal_untied_rot1": ("causal", None, dict(
        hidden_size=24, intermediate_size=40, num_hidden_layers=4, layer_types=[LIN, LIN, FULL, LIN],
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=12, linear_value_head_dim=12, linear_conv_kernel_dim=3, tie_word_embeddings=False,
        rope_parameters=_rope(1.0))),
    # the conditional layout, tied, two full layers, GQA 2, GVA 2, rotary 1.0 with mrope [2, 1, 1]
    "cond_tied_rot1": ("conditional", None, dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=5, layer_types=[LIN, FULL, LIN, LIN, FULL],
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, tie_word_embeddings=True,
        rope_parameters=_rope(1.0, mrope=[2, 1, 1]))),
    # conditional, untied, sharded, 8 layers of the default pattern, the real model's rotary (0.25, mrope, 1e7)
    "cond_untied_sharded": ("conditional", 40_000, dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
        linear_value_head_dim=8, tie_word_embeddings=False,
        rope_parameters=_rope(0.25, theta=10_000_000.0, mrope=[2, 1, 1]))),
    # conditional, untied, GQA 4, GVA 1 with Dk != Dv, rotary 0.5, mrope section
    "cond_untied_gqa4": ("conditional", None, dict(
        hidden_size=40, intermediate_size=64, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL],
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, linear_num_key_heads=3, linear_num_value_heads=3,
        linear_key_head_dim=8, linear_value_head_dim=16, tie_word_embeddings=False,
        rope_parameters=_rope(0.5, mrope=[2, 1, 1]))),
}


def build_checkpoint(out_dir: Path, name: str, seed: int = 0) -> Path:
    layout, shard, fields = CONFIGS[name]
    return make_checkpoint(out_dir, layout=layout, seed=seed, perturb=0.1, max_shard_bytes=shard,
                           vocab_size=VOCAB, **fields)


@dataclass
class Reference:
    """transformers' model of one checkpoint, its full logits memoised per token row."""

    model: torch.nn.Module
    letters: list[int] = field(default_factory=lambda: list(LETTERS))
    _logits: dict = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: Path) -> "Reference":
        return cls(load_reference(model_dir))

    def logits(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._logits:
            with torch.no_grad():
                self._logits[key] = self.model(input_ids=torch.tensor([ids])).logits[0].float()  # [n, V]
        return self._logits[key]

    def answers(self, ids: list[int], slots: list[int], nopts: list) -> list[list[float]]:
        """Per slot: softmax over the logits at that position of its options: the first n letters for a count n, else
        the given token ids."""
        full = self.logits(ids)
        return [torch.softmax(full[s, option_ids(self.letters, n)], -1).tolist() for s, n in zip(slots, nopts)]


def option_ids(letters: list[int], spec) -> torch.Tensor:
    """One slot's option token ids: the first `spec` letters for a count, else the ids themselves."""
    return torch.tensor(letters[:spec] if isinstance(spec, int) else list(spec), dtype=torch.long)


def max_abs_diff(ours: list[list[float]], ref: list[list[float]]) -> float:
    assert len(ours) == len(ref), f"{len(ours)} answers, reference has {len(ref)}"
    worst = 0.0
    for a, b in zip(ours, ref):
        assert len(a) == len(b), f"answer has {len(a)} options, reference {len(b)}"
        d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
        worst = max(worst, d.abs().max().item())
    return worst


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()
