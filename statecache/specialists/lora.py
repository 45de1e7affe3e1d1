"""All routes' LoRA adapters stacked per fused projection, and the per-forward hook the model's matmuls call.

statecache.loader fuses projections (GDN in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up), so one `Site` holds,
for one fused weight W [out, in], each route's adapters on its modules side by side: A_k [rb, in] (the modules' A
rows, zero-padded to the site's largest rank sum) and B_k [out, rb] block-structured (each module's B in its own
output rows and rank columns, scaling folded in); route 0 (the trunk) is all zeros. A token of route k computes

    y = x @ W.T + (x @ A_k.T) @ B_k.T,

which is peft's ``base(x) + lora_B(lora_A(x)) * scaling`` summed over that route's modules. Every adapter stays
resident and the route is a device tensor read inside the forward, so one CUDA graph serves every route. A binding
is made per forward: `FixedRoute` (one route for every token: the chunk runner), `TokenRoutes` (a given route per
token: batched hits of rows with different routes), `RoutedRows` (packed rows that pick their own route: the plain
path); the model calls its `feature` with the hidden state entering the router's layer and its `apply` at each
projection.
Knows nothing of files (statecache.specialists.folder), checkpoints or rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Site:
    """One fused projection's adapters for every route: A [R, rb, in], B [R, out, rb] (route 0, the trunk, zeros;
    each route's modules side by side in its rb rank rows, zero-padded; B block-structured, scaling folded in)."""

    A: torch.Tensor
    B: torch.Tensor

    @property
    def rb(self) -> int:
        return self.A.shape[1]

    @classmethod
    def stack(cls, fin: int, mods: list[tuple[str, int]], routes: list[dict[str, tuple]]) -> "Site":
        """mods: the fused weight's modules and their output rows, in order; routes: per adapter route (1, 2, ...),
        {module: (A [r, in], B [rows, r], scaling)} (float32)."""
        rb = max(sum(a.shape[0] for a, _, _ in r.values()) for r in routes) or 1
        out = sum(rows for _, rows in mods)
        A = torch.zeros(len(routes) + 1, rb, fin)
        B = torch.zeros(len(routes) + 1, out, rb)
        for k, r in enumerate(routes, 1):
            col = row = 0
            for mod, rows in mods:
                if mod in r:
                    a, b, s = r[mod]
                    A[k, col : col + a.shape[0]] = a
                    B[k, row : row + rows, col : col + a.shape[0]] = b * s
                    col += a.shape[0]
                row += rows
        return cls(A, B)


class StackedLora:
    """Every site's A and B for all routes in two flat buffers, A_all [R, sum of rb * in] and B_all [R, sum of out *
    rb] (row 0: the trunk's zeros), so one gather per buffer picks a route's adapters for every site at once. Sites are
    keyed by (layer, name: in | out | qkv | o | gate_up | down); `views(a, b)` cuts one route's rows into them."""

    def __init__(self, n_routes: int, sites: dict[tuple[int, str], Site], device="cpu", dtype=torch.float32):
        if not sites:
            raise ValueError("no adapter sites")
        self.n_routes = n_routes
        self.split = min(i for i, _ in sites)
        self.layout: dict[tuple[int, str], tuple[int, int, int, int, int]] = {}  # offA, rb, in, offB, out
        oa = ob = 0
        for key, s in sites.items():
            R, rb, fin = s.A.shape
            out = s.B.shape[1]
            if R != n_routes or s.B.shape != (R, out, rb):
                raise ValueError(f"site {key}: A {tuple(s.A.shape)} and B {tuple(s.B.shape)} do not stack")
            self.layout[key] = (oa, rb, fin, ob, out)
            oa += rb * fin
            ob += out * rb
        self.A_all = torch.empty(n_routes, oa, device=device, dtype=dtype)
        self.B_all = torch.empty(n_routes, ob, device=device, dtype=dtype)
        for key, s in sites.items():
            a0, rb, fin, b0, out = self.layout[key]
            self.A_all[:, a0 : a0 + rb * fin].copy_(s.A.reshape(n_routes, -1))
            self.B_all[:, b0 : b0 + out * rb].copy_(s.B.reshape(n_routes, -1))
        self.nbytes = (self.A_all.numel() + self.B_all.numel()) * self.A_all.element_size()

    def views(self, a: torch.Tensor, b: torch.Tensor) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """a [A_all's width], b [B_all's]: one route's rows -> {site: (A [rb, in], B [out, rb])}, views."""
        return {key: (a[a0 : a0 + rb * fin].view(rb, fin), b[b0 : b0 + out * rb].view(out, rb))
                for key, (a0, rb, fin, b0, out) in self.layout.items()}


class FixedRoute:
    """Every token runs with `route` (a long device tensor of one element): the route's adapters are gathered from
    the stacks once per forward (two copies of one route's weights), then each site costs two skinny matmuls.
    `feature` keeps the tokens' router features f [T, H] (float32) for the caller to sum over its real tokens."""

    def __init__(self, lora: StackedLora, router, route: torch.Tensor):
        self.router, self.router_layer = router, router.layer
        r = route.reshape(1)
        self.sites = lora.views(lora.A_all.index_select(0, r)[0], lora.B_all.index_select(0, r)[0])
        self.f: torch.Tensor | None = None

    def apply(self, i: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T of layer i's `site` (a fresh tensor the caller owns) -> y plus the route's LoRA term, added in
        place (one GEMM accumulating into y, no copy of y)."""
        e = self.sites.get((i, site))
        if e is None:
            return y
        return y.addmm_(x @ e[0].T, e[1].T)

    def feature(self, h: torch.Tensor) -> None:
        self.f = self.router.features(h)


class TokenRoutes:
    """Each token runs with its own route: route_tok [T] (long, on the device), e.g. batched hits of rows with
    different routes (a per-sequence route expanded to its tokens). Each site adds, for every adapter route, its
    LoRA term masked to that route's tokens. `feature` keeps the tokens' router features f [T, H] (float32)."""

    def __init__(self, lora: StackedLora, router, route_tok: torch.Tensor | None = None):
        self.lora, self.router, self.router_layer = lora, router, router.layer
        self.f: torch.Tensor | None = None
        self.masks: list[torch.Tensor] = []
        R = lora.n_routes
        self.sites = {key: (lora.A_all[:, a0 : a0 + rb * fin].view(R, rb, fin), lora.B_all[:, b0 : b0 + out * rb].view(R, out, rb))
                      for key, (a0, rb, fin, b0, out) in lora.layout.items()}
        if route_tok is not None:
            self.set_routes(route_tok)

    def set_routes(self, route_tok: torch.Tensor) -> None:
        dtype = self.lora.A_all.dtype
        self.masks = [(route_tok == r).to(dtype)[:, None] for r in range(1, self.lora.n_routes)]

    def feature(self, h: torch.Tensor) -> None:
        self.f = self.router.features(h)

    def apply(self, i: int, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = self.sites.get((i, site))
        if e is None:
            return y
        A, B = e
        for r, m in enumerate(self.masks, 1):
            y.addmm_((x @ A[r].T) * m, B[r].T)
        return y


class RoutedRows(TokenRoutes):
    """Packed rows that pick their own route inside the forward: seq [T] (long) gives each token's row, real [T]
    (bool, or None when every token is real) which tokens count, n_rows the number of rows. At the router's layer the
    row's mean feature gives its route (`routes` [n_rows]) and its tokens run the layers after with it (mixed routes
    in one forward)."""

    def __init__(self, lora: StackedLora, router, seq: torch.Tensor, real: torch.Tensor | None, n_rows: int):
        super().__init__(lora, router)
        self.seq, self.real, self.n_rows = seq, real, n_rows
        self.routes: torch.Tensor | None = None

    def feature(self, h: torch.Tensor) -> None:
        f = self.router.features(h)  # [T, H]
        w = torch.ones_like(self.seq, dtype=torch.float32) if self.real is None else self.real.float()
        sums = torch.zeros(self.n_rows, f.shape[1], device=f.device).index_add_(0, self.seq, f * w[:, None])
        counts = torch.zeros(self.n_rows, device=f.device).index_add_(0, self.seq, w)
        self.routes = self.router.logits(sums / counts.clamp_min(1)[:, None]).argmax(-1)  # [n_rows]
        self.set_routes(self.routes.index_select(0, self.seq))
