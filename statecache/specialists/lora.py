"""All routes' LoRA adapters stacked per fused projection, and the per-forward hook the model's matmuls call.

statecache.loader fuses projections (GDN in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up), so one `Site` holds,
for one fused weight W [out, in], every route's adapters on its modules side by side: A [(R-1) * rb, in] (route k's
modules' A rows in its block k-1 of rb rows, zero-padded) and B [out, (R-1) * rb] block-structured (each module's B
in its own output rows and its own columns, scaling folded in). For a token of route k the site computes

    y = x @ W.T + ((x @ A.T) * sel_k) @ B.T,    sel_k = 1 on block k-1, 0 elsewhere (all zero for the trunk),

which is peft's ``base(x) + lora_B(lora_A(x)) * scaling`` for each module of that route. Every adapter stays
resident and the route is a device tensor read inside the forward, so one CUDA graph serves every route, and a
packed forward may mix routes (sel per token). A binding (`FixedRoute`, `RoutedRows`) is made per forward; the model
calls its `feature` with the hidden state entering the router's layer and its `apply` at each projection.
Knows nothing of files (statecache.specialists.folder), checkpoints or rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Site:
    A: torch.Tensor  # [(R-1) * rb, in]
    B: torch.Tensor  # [out, (R-1) * rb], scaling folded in
    rb: int  # rows of each route's block

    @classmethod
    def stack(cls, fin: int, mods: list[tuple[str, int]], routes: list[dict[str, tuple]]) -> "Site":
        """mods: the fused weight's modules and their output rows, in order; routes: per adapter route,
        {module: (A [r, in], B [rows, r], scaling)} (float32)."""
        rb = max(sum(a.shape[0] for a, _, _ in r.values()) for r in routes) or 1
        out = sum(rows for _, rows in mods)
        A = torch.zeros(len(routes) * rb, fin)
        B = torch.zeros(out, len(routes) * rb)
        for k, r in enumerate(routes):
            col = k * rb
            row = 0
            for mod, rows in mods:
                if mod in r:
                    a, b, s = r[mod]
                    A[col : col + a.shape[0]] = a
                    B[row : row + rows, col : col + a.shape[0]] = b * s
                    col += a.shape[0]
                row += rows
        return cls(A, B, rb)

    def to(self, device, dtype) -> "Site":
        return Site(self.A.to(device, dtype).contiguous(), self.B.to(device, dtype).contiguous(), self.rb)


class StackedLora:
    """Sites keyed by (layer, site name: in | out | qkv | o | gate_up | down) for `n_routes` routes (0: trunk)."""

    def __init__(self, n_routes: int, sites: dict[tuple[int, str], Site]):
        if not sites:
            raise ValueError("no adapter sites")
        self.n_routes, self.sites = n_routes, sites
        self.split = min(i for i, _ in sites)
        self.nbytes = sum(s.A.numel() * s.A.element_size() + s.B.numel() * s.B.element_size() for s in sites.values())


class _Binding:
    """One forward's view of the stacked adapters: which route each token runs with."""

    route_tok: torch.Tensor  # [T] or [1] long: each token's route (or one for all)

    def __init__(self, lora: StackedLora, router):
        self.lora, self.router, self.router_layer = lora, router, router.layer
        self._sel: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def _sel_for(self, rb: int, dtype) -> torch.Tensor:
        s = self._sel.get((rb, dtype))
        if s is None:
            k = torch.arange(1, self.lora.n_routes, device=self.route_tok.device)
            s = (self.route_tok[:, None] == k[None]).to(dtype).repeat_interleave(rb, dim=1)  # [T|1, (R-1) * rb]
            self._sel[(rb, dtype)] = s
        return s

    def apply(self, i: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T of layer i's `site` -> y plus each token's route's LoRA term."""
        e = self.lora.sites.get((i, site))
        if e is None:
            return y
        return torch.addmm(y, (x @ e.A.T) * self._sel_for(e.rb, x.dtype), e.B.T)

    def feature(self, h: torch.Tensor) -> None:
        raise NotImplementedError


class FixedRoute(_Binding):
    """Every token runs with `route` (a long device tensor of one element); `feature` keeps the tokens' router
    features f [T, H] (float32) for the caller to sum over its real tokens."""

    def __init__(self, lora: StackedLora, router, route: torch.Tensor):
        super().__init__(lora, router)
        self.route_tok = route.reshape(1)
        self.f: torch.Tensor | None = None

    def feature(self, h: torch.Tensor) -> None:
        self.f = self.router.features(h)


class RoutedRows(_Binding):
    """Packed rows that pick their own route inside the forward: seq [T] (long) gives each token's row, real [T]
    (bool, or None when every token is real) which tokens count, n_rows the number of rows. At the router's layer the
    row's mean feature gives its route (`routes` [n_rows]) and its tokens run the upper layers with it."""

    def __init__(self, lora: StackedLora, router, seq: torch.Tensor, real: torch.Tensor | None, n_rows: int):
        super().__init__(lora, router)
        self.seq, self.real, self.n_rows = seq, real, n_rows
        self.route_tok = torch.zeros_like(seq)
        self.routes: torch.Tensor | None = None

    def feature(self, h: torch.Tensor) -> None:
        f = self.router.features(h)  # [T, H]
        w = torch.ones_like(self.seq, dtype=torch.float32) if self.real is None else self.real.float()
        sums = torch.zeros(self.n_rows, f.shape[1], device=f.device).index_add_(0, self.seq, f * w[:, None])
        counts = torch.zeros(self.n_rows, device=f.device).index_add_(0, self.seq, w)
        self.routes = self.router.logits(sums / counts.clamp_min(1)[:, None]).argmax(-1)  # [n_rows]
        self.route_tok = self.routes.index_select(0, self.seq)
        self._sel.clear()
