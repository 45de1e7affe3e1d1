"""All routes' LoRA adapters per fused projection, folded into the projections, and the per-forward bindings that
do the adapted projections.

statecache.loader fuses projections (GDN in_proj_qkv|z|b|a, attention q|k|v, MLP gate|up), so one `Site` holds,
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
with B_cat [(R-1) * rb, out] every route's B_k.T stacked. The route selects which part of B_cat counts:
- one route for every token (`FixedRoute`: the chunk runner; `RoutedRows` with one row: a lone plain row): one
  elementwise pass per block size writes every site's B_cat with the other routes' rows zeroed into a resident
  buffer B_fixed (route 0, the trunk: all zeros), so each site costs the extended GEMM and one addmm. A lone plain
  row masks once per forward (its route is decided inside it); the chunk runner, whose route is known on the host,
  masks outside its forwards and only when the route changes (`StackedLora.hold_route`: a hit of the route the
  buffer already holds does no masking at all), so its graphs only read B_fixed;
- a route per token (`TokenRoutes`: batched hits of rows with different routes; `RoutedRows` with several rows:
  the packed plain path): a [T, R-1] token-route mask made once per forward zeroes each token's other routes' part
  of xa (one elementwise kernel per site) before the addmm with the whole B_cat.
The route is a device tensor read inside the forward, so one CUDA graph serves every route. B_fixed's route is
tracked on the host (`fixed_route`): every mask sets it (None when the route is known on the device only), and
whoever replays a graph that masks inside (statecache.plain's lone-row graphs) calls `forget_route` after it.
The model calls a binding's `attach` with its weights, its `feature` with the hidden state entering the router's
layer and its `project(i, site, x, W)` in place of x @ W.T at every projection.
Knows nothing of files (statecache.specialists.folder), checkpoints or rows.
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


# where a site's fused weight lives in statecache.loader's Weights: (the layer's attribute or None, the field)
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
    one [sites, R-1, rb * out] stack per block size (`B_src`), next to a same-shaped buffer (`B_fixed`) that
    `mask_route` fills with one route's rows (the others zero); `fixed_route` is that route when the host knows it
    (set by `hold_route`), else None."""

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
        self.B_fixed: list[torch.Tensor] = []
        self._B: dict[tuple[int, str], torch.Tensor] = {}  # site -> B_cat [Rp * rb, out], a view of B_src
        self._Bf: dict[tuple[int, str], torch.Tensor] = {}  # the same view of B_fixed
        for size, keys in groups.items():
            src = torch.empty(len(keys), Rp, size, device=self.device, dtype=dtype)
            for j, key in enumerate(keys):
                src[j].copy_(sites[key].B[1:].transpose(1, 2).reshape(Rp, size))  # route k's B_k.T [rb, out]
            fixed = torch.zeros_like(src)
            for j, key in enumerate(keys):
                lay = self.layout[key]
                self._B[key] = src[j].view(Rp * lay.rb, lay.out)
                self._Bf[key] = fixed[j].view(Rp * lay.rb, lay.out)
            self.B_src.append(src)
            self.B_fixed.append(fixed)
        self.route_ids = torch.arange(1, n_routes, device=self.device)  # the adapter routes, in B_cat's order
        esize = torch.empty((), dtype=dtype).element_size()
        # device bytes the specialists add: the A rows in the extended weights, B_src and B_fixed
        self.nbytes = esize * (sum(a.numel() for a in self._A.values()) + 2 * sum(b.numel() for b in self.B_src))
        self.fixed_owner = None  # the binding (or the chunk runner) whose route B_fixed holds
        self.fixed_route: int | None = None  # that route when known on the host (hold_route), else None
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
        """Fold the adapter routes' A into the model's weights (statecache.loader.Weights): each adapted site's W
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

    # ---- per forward ------------------------------------------------------------------------------------------------

    def mask_route(self, route: torch.Tensor, owner, known: int | None = None) -> None:
        """B_fixed = every site's B_cat with only `route`'s rows kept (route 0: all zeros); route a long device
        tensor of one element, `known` its value when the host knows it (never inside a graph capture: a replay
        would rewrite B_fixed unseen). One elementwise kernel per block size (plus one comparison)."""
        if known is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a route known on the host is masked outside graph captures (hold_route)")
        keep = (self.route_ids == route.reshape(1)).view(1, -1, 1)  # [1, Rp, 1] bool
        for src, fixed in zip(self.B_src, self.B_fixed):
            torch.mul(src, keep, out=fixed)
        self.fixed_owner, self.fixed_route = owner, known

    def hold_route(self, route: int, route_t: torch.Tensor, owner) -> bool:
        """Make B_fixed hold `route` (route_t: the same as a long device tensor of one element) for `owner`'s
        forwards (FixedRoute bindings made with owner=): masked unless it holds that route already. True when it
        masked. Call it outside graph captures, before every forward that reads B_fixed."""
        self.fixed_owner = owner
        if self.fixed_route == route:
            return False
        self.mask_route(route_t, owner, int(route))
        return True

    def forget_route(self) -> None:
        """B_fixed may have been rewritten where the host could not see (a graph replay that masks inside): the next
        hold_route masks."""
        self.fixed_route = None


class _Binding:
    """What the model calls during one forward (see the module docstring); subclasses decide the routes."""

    def __init__(self, lora: StackedLora, router):
        self.lora, self.router, self.router_layer = lora, router, router.layer
        self.f: torch.Tensor | None = None
        self._fixed = False  # one route for every token: B_fixed holds it
        self._owner: object = self  # whose route B_fixed must hold when a fixed route projects
        self._tok: torch.Tensor | None = None  # else [T, Rp, 1]: 1 where a token runs with that adapter route

    def attach(self, weights) -> None:
        self.lora.attach(weights)

    def feature(self, h: torch.Tensor) -> None:
        """h [T, H], the hidden state entering the router's layer: keeps the tokens' router features f [T, H]."""
        self.f = self.router.features(h)

    def _fix(self, route: torch.Tensor) -> None:
        self.lora.mask_route(route, self)
        self._fixed, self._tok = True, None

    def set_routes(self, route_tok: torch.Tensor) -> None:
        """route_tok [T] (long, on the device): each token's route."""
        self._tok = (route_tok[:, None] == self.lora.route_ids[None]).to(self.lora.dtype).unsqueeze(-1)
        self._fixed = False

    def project(self, i: int, site: str, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W.T of layer i's `site` plus each token's route's LoRA term: x @ W.T where the site has no
        adapter; else one GEMM with W_ext, then one addmm (fixed route) or one mask and one addmm (token routes)
        into the result's first `out` columns (a row-strided view of the GEMM's output)."""
        key = (i, site)
        lay = self.lora.layout.get(key)
        if lay is None:
            return x @ W.T
        y_full = x @ self.lora.extended(key, W).T  # [T, out + Rp * rb]
        y, xa = y_full[:, : lay.out], y_full[:, lay.out :]
        if self._fixed:
            if self.lora.fixed_owner is not self._owner:
                raise RuntimeError("another binding has rewritten the fixed-route adapters since this one masked them")
            return y.addmm_(xa, self.lora._Bf[key])
        if self._tok is None:
            raise RuntimeError(f"layer {i} is adapted but no route is set yet (router layer {self.router_layer})")
        T, Rp = x.shape[0], self.lora.n_routes - 1
        return y.addmm_((xa.view(T, Rp, lay.rb) * self._tok).view(T, Rp * lay.rb), self.lora._B[key])


class FixedRoute(_Binding):
    """Every token runs with `route` (a long device tensor of one element): every site's B_cat is masked to that
    route once, here, so each site costs its extended GEMM and one addmm; with `owner` given nothing is masked here:
    the owner makes B_fixed hold the route (`StackedLora.hold_route`) before each forward (the chunk runner, so its
    graphs do not mask). `feature` keeps the tokens' router features f [T, H] (float32) for the caller to sum over
    its real tokens."""

    def __init__(self, lora: StackedLora, router, route: torch.Tensor, owner=None):
        super().__init__(lora, router)
        if owner is None:
            self._fix(route)
        else:
            self._fixed, self._owner = True, owner


class TokenRoutes(_Binding):
    """Each token runs with its own route: route_tok [T] (long, on the device), e.g. batched hits of rows with
    different routes (a per-sequence route expanded to its tokens). `feature` keeps the tokens' router features."""

    def __init__(self, lora: StackedLora, router, route_tok: torch.Tensor | None = None):
        super().__init__(lora, router)
        if route_tok is not None:
            self.set_routes(route_tok)


class RoutedRows(_Binding):
    """Packed rows that pick their own route inside the forward: seq [T] (long) gives each token's row, real [T]
    (bool, or None when every token is real) which tokens count, n_rows the number of rows. At the router's layer the
    row's mean feature gives its route (`routes` [n_rows]) and its tokens run the layers after with it: one row as a
    fixed route, several as token routes (mixed routes in one forward)."""

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
        if self.n_rows == 1:
            self._fix(self.routes)
        else:
            self.set_routes(self.routes.index_select(0, self.seq))
