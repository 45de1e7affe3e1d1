"""How a forward's stateful token mixing sees its tokens: the two views the model is run with.

- `PackedMixer`: B independent sequences packed into T tokens (cu_seqlens), each starting from nothing: the
  plain path.
- `ChunkMixer`: one chunk of one sequence continuing from the saved state in a `ChunkState` (static buffers):
  the conv runs over [saved inputs | chunk]; the delta rule starts from the saved S (the model gives padding
  g = 0 and beta = 0 through `live`, so S stops at the real end); attention writes the chunk's K/V at [start, start + L) and reads
  [cached K/V | causal chunk]. Chunk start and real length are device tensors the caller hands in (views of its
  graph's input buffer), so a CUDA graph captured once serves every position.
Neither knows weights or layers beyond the slot index `j` (GDN) / `a` (attention) it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PackedMixer:
    def __init__(self, kernels, cu: torch.Tensor, max_len: int):
        self.k, self.cu, self.max_len = kernels, cu, max_len  # cu: int32 [B + 1]
        self.seq_cu = cu if cu.numel() > 2 else None  # one sequence: the GDN kernels' plain (non-varlen) form
        self.live = None  # no padding tokens
        # chunked prefill across layers: a long eager packed forward calls `every_layers()` every `layers_every`
        # layers (the caller answers short work that arrived meanwhile; never set while a CUDA graph is captured)
        self.every_layers, self.layers_every = None, 4

    def after_layer(self, i: int) -> None:
        if self.every_layers is not None and (i + 1) % self.layers_every == 0:
            self.every_layers()

    def conv(self, j: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.k.conv(x[None], w, self.seq_cu)[0]

    def delta(self, j, q, k, v, g, beta):
        o, _ = self.k.delta(q[None], k[None], v[None], g[None], beta[None], None, self.seq_cu)
        return o[0]

    def attend(self, a, q, k, v, scale):
        return self.k.attend_packed(q, k, v, self.cu, self.max_len, scale)


@dataclass
class ChunkState:
    """The static buffers a chunk continues from and writes to (one sequence)."""

    conv: torch.Tensor  # [G, W - 1, C]: the last W - 1 real conv inputs of each GDN layer
    S: torch.Tensor  # [G, Hv, Dk, Dv] float32: each GDN layer's recurrent state
    K: torch.Tensor  # [A, P_max, Hkv, D]: each attention layer's keys of [0, P_max)
    V: torch.Tensor  # [A, P_max, Hkv, D]

    @classmethod
    def allocate(cls, cfg, max_pos: int, device, dtype) -> "ChunkState":
        G, A = len(cfg.linear_layers), len(cfg.full_layers)
        W = cfg.linear_conv_kernel_dim
        z = lambda *s, dt=dtype: torch.zeros(*s, device=device, dtype=dt)  # noqa: E731
        return cls(
            conv=z(G, W - 1, cfg.conv_dim),
            S=z(G, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dt=torch.float32),
            K=z(A, max_pos, cfg.num_key_value_heads, cfg.head_dim),
            V=z(A, max_pos, cfg.num_key_value_heads, cfg.head_dim),
        )

    def reset(self) -> None:
        self.conv.zero_()
        self.S.zero_()


class ChunkMixer:
    """One chunk of L (bucketed) tokens continuing from `st`; keys span [0, span). start, real: long scalar device
    tensors, the chunk's first position and its real (unpadded) length."""

    def __init__(self, kernels, st: ChunkState, L: int, span: int, start: torch.Tensor, real: torch.Tensor):
        self.k, self.st, self.L, self.span, self.start = kernels, st, L, span, start
        dev = st.S.device
        ar = torch.arange(L, device=dev)
        self.pos = start + ar  # [L] absolute positions
        self.live, self.real = ar < real, real  # live [L]: real tokens (the model zeroes padding's gates with it)

    def conv(self, j: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.k.conv_into(x, w, self.st.conv[j], self.real)

    def delta(self, j, q, k, v, g, beta):
        return self.k.delta_into(q, k, v, g, beta, self.st.S[j])

    def attend(self, a, q, k, v, scale):
        self.st.K[a].index_copy_(0, self.pos, k)
        self.st.V[a].index_copy_(0, self.pos, v)
        return self.k.attend_span(q, self.st.K[a, : self.span], self.st.V[a, : self.span], self.start, scale)
