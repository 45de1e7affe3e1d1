"""All routes' LoRA adapters per fused projection, folded into the projections, and the per-forward bindings that
do the adapted projections.

statecache.model.loader fuses projections (GDN in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up), so one `Site` holds,
for one fused weight W [out, in], each route's adapters on its modules side by side: A_k [rb, in] (the modules' A
rows, zero-padded to the site's largest rank sum) and B_k [out, rb] block-structured (each module's B in its own
output rows and rank columns, scaling folded in). A token of route k computes

    y = x @ W.T + (x @ A_k.T) @ B_k.T,

which is peft's ``base(x) + lora_B(lora_A(x)) * scaling`` summed over that route's modules.

How it runs (`StackedLora`): every adapter route's A is folded into the projection itself. `attach` gives each
adapted site of the model's weights an extended weight W_ext = [W; A_1; ...; A_{R-1}] ([out + (R-1) * rb, in]) and
points the model's W at its first `out` rows (a view: the trunk's own matmul reads the same memory as before, and
the weights are not held twice). One GEMM y_full = x @ W_ext.T then gives the projection y = y_full[:, :out] and
every route's x @ A_k.T in y_full[:, out:] (xa, [T, (R-1) * rb]); one more GEMM adds xa @ B_cat into y in place,
with B_cat [(R-1) * rb, out] every route's B_k.T stacked. The route selects which part of B_cat counts: a [T, R-1]
token-route mask made once per forward (`TokenRoutes`: each sequence of a packed forward with its own route, a
per-token route index) zeroes each token's other routes' part of xa (one elementwise kernel per site) before the
addmm with the whole B_cat. The route is a device tensor read inside the forward, so one CUDA graph serves every mix
of routes.
The model calls a binding's `attach` with its weights, its `feature` with the hidden state entering the router's
layer and its `project(i, site, x, W)` in place of x @ W.T at every projection.
Knows nothing of files (statecache.model.specialists.folder), checkpoints or rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch



def _same_device(a, b) -> bool:
    """torch.device("cuda") and torch.device("cuda:0") name one device."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index or 0) == (b.index or 0)

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


# where a site's fused weight lives in statecache.model.loader's Weights: (the layer's attribute or None, the field)
FIELDS = {"in": ("mixer", "in_w"), "out": ("mixer", "out_w"), "qkv": ("mixer", "qkv_w"), "o": ("mixer", "o_w"),
          "gate_up": (None, "gate_up_w"), "down": (None, "down_w")}


@dataclass(frozen=True)
class Layout:
    """One site's sizes: rank rows per route rb, input features fin, output rows out."""

    rb: int
    fin: int
    out: int


class StackedLora:
    """Every site's adapters for the routes 1..R-1 (route 0, the trunk, has none; a Site's row 0 is ignored).

    Sites are keyed by (layer, name: in | out | qkv | o | gate_up | down). A [(R-1) * rb, in] per site waits on the
    host until `attach` folds it into the model's weights; B_cat [(R-1) * rb, out] per site lives on the device in
    one [sites, R-1, rb * out] stack per block size (`B_src`)."""

    def __init__(self, n_routes: int, sites: dict[tuple[int, str], Site], device="cpu", dtype=torch.float32):
        if not sites:
            raise ValueError("no adapter sites")
        if n_routes < 2:
            raise ValueError(f"{n_routes} routes: the trunk and at least one adapter route are needed")
        self.n_routes, self.device, self.dtype = n_routes, torch.device(device), dtype
        Rp = n_routes - 1
        self.split = min(i for i, _ in sites)
        self.layout: dict[tuple[int, str], Layout] = {}
        self._A: dict[tuple[int, str], torch.Tensor] = {}  # host, float32: [Rp * rb, in]
        groups: dict[int, list[tuple[int, str]]] = {}
        for key, s in sites.items():
            R, rb, fin = s.A.shape
            out = s.B.shape[1]
            if key[1] not in FIELDS:
                raise ValueError(f"site {key}: unknown projection {key[1]!r} (one of {sorted(FIELDS)})")
            if R != n_routes or s.B.shape != (R, out, rb):
                raise ValueError(f"site {key}: A {tuple(s.A.shape)} and B {tuple(s.B.shape)} do not stack")
            self.layout[key] = Layout(rb, fin, out)
            self._A[key] = s.A[1:].reshape(Rp * rb, fin).float().cpu()
            groups.setdefault(rb * out, []).append(key)
        self.B_src: list[torch.Tensor] = []
        self._B: dict[tuple[int, str], torch.Tensor] = {}  # site -> B_cat [Rp * rb, out], a view of B_src
        for size, keys in groups.items():
            src = torch.empty(len(keys), Rp, size, device=self.device, dtype=dtype)
            for j, key in enumerate(keys):
                src[j].copy_(sites[key].B[1:].transpose(1, 2).reshape(Rp, size))  # route k's B_k.T [rb, out]
            for j, key in enumerate(keys):
                lay = self.layout[key]
                self._B[key] = src[j].view(Rp * lay.rb, lay.out)
            self.B_src.append(src)
        self.route_ids = torch.arange(1, n_routes, device=self.device)  # the adapter routes, in B_cat's order
        esize = torch.empty((), dtype=dtype).element_size()
        # device bytes the specialists add: the A rows in the extended weights and B_src
        self.nbytes = esize * (sum(a.numel() for a in self._A.values()) + sum(b.numel() for b in self.B_src))
        self._ext: dict[tuple[int, str], torch.Tensor] = {}  # site -> W_ext of the weights attached
        self._weights = None  # weakref to the Weights attached

    # ---- the model's weights ----------------------------------------------------------------------------------------

    @staticmethod
    def _home(weights, key: tuple[int, str]) -> tuple[object, str]:
        i, site = key
        part, field = FIELDS[site]
        layer = weights.layers[i]
        return (layer if part is None else getattr(layer, part)), field

    def weight(self, weights, key: tuple[int, str]) -> torch.Tensor:
        """The model's fused weight W [out, in] of a site (a view of its W_ext once attached)."""
        obj, field = self._home(weights, key)
        return getattr(obj, field)

    def attached(self, weights) -> bool:
        return (self._weights is not None and self._weights() is weights
                and all(self.weight(weights, k).data_ptr() == e.data_ptr() for k, e in self._ext.items()))

    def attach(self, weights) -> None:
        """Fold the adapter routes' A into the model's weights (statecache.model.loader.Weights): each adapted site's W
        becomes the first rows of a new W_ext = [W; A_1; ...; A_{R-1}] (W's values unchanged, the old tensor freed
        site by site). A no-op when these weights are attached already; attaching other weights (or re-attaching
        weights another StackedLora took over) rebuilds. Do it before capturing any CUDA graph on these weights
        (ChunkRunner and PlainPath do, when built with specialists): a graph captured before reads the old W."""
        if self.attached(weights):
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("specialists must be attached to the model's weights before any CUDA graph capture "
                               "(build the ChunkRunner / PlainPath with specialists= first)")
        if len(weights.layers) <= max(i for i, _ in self.layout):
            raise ValueError(f"specialists adapt layer {max(i for i, _ in self.layout)}, the model has "
                             f"{len(weights.layers)} layers")
        for key, lay in self.layout.items():  # check everything before changing anything
            W = self.weight(weights, key)
            if tuple(W.shape) != (lay.out, lay.fin):
                raise ValueError(f"specialists site {key}: the model's weight is {tuple(W.shape)}, the adapters "
                                 f"expect ({lay.out}, {lay.fin})")
            if W.dtype != self.dtype or not _same_device(W.device, self.device):
                raise ValueError(f"specialists site {key}: the model's weight is {W.dtype} on {W.device}, the "
                                 f"adapters were loaded as {self.dtype} on {self.device}")
        Rp = self.n_routes - 1
        self.release()
        prev = getattr(weights, "_statecache_lora", None)  # the StackedLora these weights were attached to
        if prev is not None and prev() is not None:
            prev().release()  # its extended weights are about to be replaced: do not hold them
        for key, lay in self.layout.items():
            obj, field = self._home(weights, key)
            W = getattr(obj, field)
            W_ext = torch.empty(lay.out + Rp * lay.rb, lay.fin, device=self.device, dtype=self.dtype)
            W_ext[: lay.out].copy_(W)
            W_ext[lay.out :].copy_(self._A[key])
            setattr(obj, field, W_ext[: lay.out])
            self._ext[key] = W_ext
            del W
        self._weights = weakref.ref(weights)
        weights._statecache_lora = weakref.ref(self)

    def release(self) -> None:
        """Forget the weights attached (their views keep what they still use); the next forward re-attaches."""
        self._ext, self._weights = {}, None

    def extended(self, key: tuple[int, str], W: torch.Tensor) -> torch.Tensor:
        """W_ext of a site, checked to be the one the model's W [out, in] is a view of."""
        W_ext = self._ext.get(key)
        if W_ext is None or W.data_ptr() != W_ext.data_ptr() or W.shape[0] != self.layout[key].out:
            raise RuntimeError(f"specialists site {key}: the model's weight is not this StackedLora's extended "
                               "projection (attach the model's weights first: StackedLora.attach)")
        return W_ext


class _Binding:
    """What the model calls during one forward (see the module docstring); subclasses decide the routes."""

    def __init__(self, lora: StackedLora, router):
        self.lora, self.router, self.router_layer = lora, router, router.layer
        self.f: torch.Tensor | None = None
        self._tok: torch.Tensor | None = None  # [T, Rp, 1]: 1 where a token runs with that adapter route

    def attach(self, weights) -> None:
        self.lora.attach(weights)

    def feature(self, h: torch.Tensor) -> None:
        """h [T, H], the hidden state entering the router's layer: keeps the tokens' router features f [T, H]."""
        self.f = self.router.features(h)

    def set_routes(self, route_tok: torch.Tensor) -> None:
        """route_tok [T] (long, on the device): each token's route."""
        self._tok = (route_tok[:, None] == self.lora.route_ids[None]).to(self.lora.dtype).unsqueeze(-1)

    def project(self, i: int, site: str, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W.T of layer i's `site` plus each token's route's LoRA term: x @ W.T where the site has no
        adapter; else one GEMM with W_ext, then one mask and one addmm into the result's first `out` columns (a
        row-strided view of the GEMM's output)."""
        key = (i, site)
        lay = self.lora.layout.get(key)
        if lay is None:
            return x @ W.T
        y_full = x @ self.lora.extended(key, W).T  # [T, out + Rp * rb]
        y, xa = y_full[:, : lay.out], y_full[:, lay.out :]
        if self._tok is None:
            raise RuntimeError(f"layer {i} is adapted but no route is set yet (router layer {self.router_layer})")
        T, Rp = x.shape[0], self.lora.n_routes - 1
        return y.addmm_((xa.view(T, Rp, lay.rb) * self._tok).view(T, Rp * lay.rb), self.lora._B[key])


class TokenRoutes(_Binding):
    """Each token runs with its own route: route_tok [T] (long, on the device), e.g. batched hits of rows with
    different routes (a per-sequence route expanded to its tokens). `feature` keeps the tokens' router features."""

    def __init__(self, lora: StackedLora, router, route_tok: torch.Tensor | None = None):
        super().__init__(lora, router)
        if route_tok is not None:
            self.set_routes(route_tok)
