"""GPU check and timing of planting from the packed forward (9B shape, random weights, bf16; one device run).

One row of a 4096-token state and a 64-token question:
- plain: the lone row as one CUDA graph (the plain path's default on CUDA) and the same row packed, eager;
- cold with planting: the packed forward that also leaves the row's checkpoints (statecache.plant: the delta rule
  split at the planned positions, conv tails, K/V copied out), planted into a StateCache as the engine does it;
  the ratio to the plain row; then the same row and a 2432 + 64-token one through the planting graph
  (statecache.plant.PlantGraph, the engine's form of a lone new state on CUDA): time against the plain graph of the
  same row (the target: at most 1.05x), answer, states against the packed planting forward's, a hit from them;
- the chunked cold row of the cached path (chunk graphs), for comparison, and its checkpoints against the planted
  ones: positions, fp32 states S, conv tails, K/V (max |diff| and max |diff| / max |value|);
- a later hit from the planted state (a new 64-token question), its time and its answer against the plain forward
  and against the same hit from the chunked path's state;
- four new states of 4096 + 64 tokens in one packed forward, with and without planting.
With --f32 the state comparison is repeated in float32 with the torch kernels on the GPU (exact: ~1e-5).
Writes gpu_plant.json under --out.

Run on the device machine:  python3 bench/gpu_plant.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from statecache.cache import CacheSettings, StateCache  # noqa: E402
from statecache.kernels import FlaKernels, TorchKernels  # noqa: E402
from statecache.loader import weights_from_state_dict  # noqa: E402
from statecache.model import Qwen35  # noqa: E402
from statecache.plain import PlainPath  # noqa: E402
from statecache.runner import ChunkRunner  # noqa: E402

R: dict = {}
OUT: Path
T0 = time.perf_counter()
STATE, QUESTION = 4096, 64


def save():
    (OUT / "gpu_plant.json").write_text(json.dumps(R, indent=1))


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *a, flush=True)


def timed(fn, reps=7, warm=2):
    """Median wall milliseconds of fn, the GPU synchronised after each call (gpu_bench's timer)."""
    from gpu_bench import timed as bench_timed

    return bench_timed(fn, reps, warm)


def maxdiff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def tdiff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs().max().item()
    return {"max_abs": d, "rel": d / max(b.float().abs().max().item(), 1e-30)}


def paired(fa, fb, reps=9, warm=2):
    """Median wall milliseconds of fa and of fb, timed alternately (a, b, a, b, ...) so that a drift of the GPU's
    clocks or of the host falls on both; the GPU synchronised around each call."""
    for _ in range(warm):
        fa(), fb()
    ta, tb = [], []
    for _ in range(reps):
        for fn, ts in ((fa, ta), (fb, tb)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(1e3 * (time.perf_counter() - t))
    return round(sorted(ta)[reps // 2], 3), round(sorted(tb)[reps // 2], 3)


def rows_for(vocab: int, seed: int, n_states: int = 1, state_len: int = STATE):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_states):
        state = torch.randint(0, vocab, (state_len,), generator=g).tolist()
        qs = [torch.randint(0, vocab, (QUESTION,), generator=g).tolist() for _ in range(3)]
        out.append((state, qs))
    return out


def compare_states(planted_cache: StateCache, chunked_cache: StateCache) -> dict:
    """Per checkpoint position: the planted payload against the chunked cold row's."""
    got = {c.pos: c for c in planted_cache.index.lru_order()}
    want = {c.pos: c for c in chunked_cache.index.lru_order()}
    out = {"positions_planted": sorted(got), "positions_chunked": sorted(want)}
    for pos in sorted(set(got) & set(want)):
        (cv, S), (cv2, S2) = got[pos].payload, want[pos].payload
        out[str(pos)] = {"S": tdiff(S, S2), "conv": tdiff(cv, cv2), "S_dtype": str(S.dtype)}
    (K, V, _), (K2, V2, _) = next(iter(got.values())).group.payload, next(iter(want.values())).group.payload
    out["K"], out["V"] = tdiff(K, K2), tdiff(V, V2)
    return out


def plant(cache: StateCache, pp: PlainPath, rows, state_lens):
    """The engine's planting step: one packed forward leaving each row's checkpoints, planted into the cache."""
    outs, planted = pp.run(rows, [cache.plan(s) for s in state_lens])
    for (ids, _, _), pl in zip(rows, planted):
        cache.plant_planted(ids, len(ids), pl.snaps(), pl.K, pl.V)
    return [probs for probs, _route in outs]


def planting_graphs(args, m16, fk, pg, pe, runner, settings, state, qs, lengths):
    """Rows of each state length (+ a 64-token question) through the planting graph (statecache.plant.PlantGraph:
    the engine's form of a lone new state on CUDA), against the plain graph of the same row, timed alternately
    (target: at most 1.05x); answers, states against the packed planting forward's, a hit from them."""
    try:
        pgp = PlainPath(m16, fk, pool=runner.pool)
        if pgp.planter is None:
            raise RuntimeError("no planting graphs here (no CUDA graphs, or fla's per-chunk states failed their check)")
        R["planting_graph"] = {}
        for n_state in lengths:
            ids_n = state[:n_state] + qs[0]
            row_n = (ids_n, [len(ids_n) - 1], [4])
            t = time.perf_counter()
            ok = pgp.planter.capture(len(ids_n), 1, (4,))
            cap_s = round(time.perf_counter() - t, 1)
            if not ok:
                raise RuntimeError(f"the planting graph did not capture: {pgp.failures[:2]}")
            pcache = StateCache(runner, settings)

            def cold_graph():
                pcache.clear()
                return plant(pcache, pgp, [row_n], [n_state])

            p_graph = cold_graph()[0]
            ref_n = pg.forward([row_n])[0]
            e = {"tokens": len(ids_n), "capture_s": cap_s, "pieces": len(pgp.planter.graphs[pgp.planter.key(len(ids_n), 1, (4,))].graphs),
                 "answer_vs_plain": maxdiff(p_graph, ref_n)}
            e["plain_graph_ms"], e["cold_graph_ms"] = paired(lambda: pg.forward([row_n]), cold_graph)
            e["cold_graph_vs_plain_graph"] = round(e["cold_graph_ms"] / e["plain_graph_ms"], 4)
            e["target_le_1.05x"] = e["cold_graph_vs_plain_graph"] <= 1.05
            pk = StateCache(runner, settings)
            plant(pk, pe, [row_n], [n_state])  # the packed planting forward's checkpoints (fp32 split delta rule)
            e["states_vs_packed"] = compare_states(pcache, pk)
            h_ids = state[:n_state] + qs[1]
            h_ref = pg.forward([(h_ids, [len(h_ids) - 1], [4])])[0]
            hg = pcache.row(h_ids, n_state, [len(h_ids) - 1], [4])
            hp = pk.row(h_ids, n_state, [len(h_ids) - 1], [4])
            e["hit_path"] = hg.path
            e["hit_from_graph_state_vs_plain"] = maxdiff(hg.probs, h_ref)
            e["hit_from_packed_state_vs_plain"] = maxdiff(hp.probs, h_ref)
            R["planting_graph"][str(n_state)] = e
            log("planting graph", n_state, "+ 64 tokens:", e["cold_graph_ms"], "ms,", e["cold_graph_vs_plain_graph"],
                "x the plain graph", e["plain_graph_ms"], "ms; hit after it vs plain", e["hit_from_graph_state_vs_plain"])
            save()
            del pcache, pk
        R["planting_graph_failures"] = pgp.failures[:3]
        del pgp
    except Exception:  # noqa: BLE001
        R.setdefault("errors", []).append("planting graph: " + traceback.format_exc()[-2000:])
        log(traceback.format_exc())
    save()



def bench(args):
    from gpu_bench import build_hf  # the 9B shape with random weights, as the main bench builds it

    hf, cfg = build_hf(args.shape)
    letters = list(range(32, 58))
    sd = {k: v for k, v in hf.state_dict().items()}
    del hf
    gc.collect()
    m16 = Qwen35(weights_from_state_dict(cfg, sd, letters, "cuda", torch.bfloat16))
    fk = FlaKernels()
    if not args.no_compile:  # the product's default on CUDA
        m16.compile_elementwise()
        fk.compile_elementwise()
    R["compiled"] = not args.no_compile
    lengths = [int(x) for x in args.lengths.split(",")]
    (state, qs), = rows_for(cfg.vocab_size, 0, state_len=max(lengths + [STATE]))
    ids = state[:STATE] + qs[0]
    row = (ids, [len(ids) - 1], [4])
    settings = CacheSettings(mb=args.cache_mb)

    # plain: one graph (lone row default) and packed eager
    pg = PlainPath(m16, fk)
    t = time.perf_counter()
    p_plain = pg.forward([row])[0]
    R["plain_graph_capture_s"] = round(time.perf_counter() - t, 1)
    R["plain_graph_ms"] = timed(lambda: pg.forward([row]))
    pe = PlainPath(m16, fk, graphs=False)
    R["plain_packed_ms"] = timed(lambda: pe.forward([row]))
    log("plain: graph", R["plain_graph_ms"], "ms, packed eager", R["plain_packed_ms"], "ms")
    save()
    runner = ChunkRunner(m16, fk, max_pos=8192, max_slots=4)
    if args.graph_only:
        planting_graphs(args, m16, fk, pg, pe, runner, settings, state, qs, lengths)
        return

    # cold with planting (the packed forward + planting into the cache, as the engine does)
    cache = StateCache(runner, settings)

    def cold_plant():
        cache.clear()
        return plant(cache, pe, [row], [STATE])

    p_cold = cold_plant()[0]
    R["cold_plant_ms"] = timed(cold_plant)
    R["cold_plant_vs_plain_graph"] = round(R["cold_plant_ms"] / R["plain_graph_ms"], 4)
    R["cold_plant_vs_plain_packed"] = round(R["cold_plant_ms"] / R["plain_packed_ms"], 4)
    R["cold_plant_answer_vs_plain"] = maxdiff(p_cold, p_plain)
    R["target_cold_le_1.05x_plain_graph"] = R["cold_plant_vs_plain_graph"] <= 1.05
    log("cold with planting", R["cold_plant_ms"], "ms:", R["cold_plant_vs_plain_graph"], "x the plain graph,",
        R["cold_plant_vs_plain_packed"], "x packed eager; checkpoints", sorted(c.pos for c in cache.index.lru_order()))
    save()

    planting_graphs(args, m16, fk, pg, pe, runner, settings, state, qs, lengths)

    # the chunked cold row (today's cached path), its checkpoints against the planted ones
    chunked = StateCache(ChunkRunner(m16, fk, max_pos=8192, max_slots=4, pool=runner.pool), settings)  # own buffers
    a = chunked.row(ids, STATE, row[1], row[2])  # captures its chunk graphs
    torch.cuda.synchronize()

    def cold_chunked():
        chunked.clear()
        return chunked.row(ids, STATE, row[1], row[2])

    R["cold_chunked_ms"] = timed(cold_chunked, reps=5)
    R["cold_chunked_answer_vs_plain"] = maxdiff(a.probs, p_plain)
    cold_plant()  # the planted cache as the engine leaves it
    R["states_bf16"] = compare_states(cache, chunked)
    log("chunked cold", R["cold_chunked_ms"], "ms; planted vs chunked states", json.dumps(R["states_bf16"]))
    save()

    # a later hit from the planted state, and the same hit from the chunked path's state
    ids2 = state + qs[1]
    ref2 = pg.forward([(ids2, [len(ids2) - 1], [4])])[0]
    h = cache.row(ids2, STATE, [len(ids2) - 1], [4])
    R["hit_path"] = h.path
    R["hit_answer_vs_plain"] = maxdiff(h.probs, ref2)
    h2 = chunked.row(ids2, STATE, [len(ids2) - 1], [4])
    R["hit_planted_vs_hit_chunked"] = maxdiff(h.probs, h2.probs)
    R["hit_from_planted_ms"] = timed(lambda: cache.row(ids2, STATE, [len(ids2) - 1], [4]), reps=20, warm=3)
    R["hit_from_chunked_ms"] = timed(lambda: chunked.row(ids2, STATE, [len(ids2) - 1], [4]), reps=20, warm=3)
    log("hit from the planted state", R["hit_from_planted_ms"], "ms (path", h.path, "), from the chunked state",
        R["hit_from_chunked_ms"], "ms; answers vs plain", R["hit_answer_vs_plain"])
    save()

    # four new states in one packed forward, with and without planting
    many = rows_for(cfg.vocab_size, 1, 4)
    rows4 = [(s + q[0], [STATE + QUESTION - 1], [4]) for s, q in many]
    R["batch4_plain_packed_ms"] = timed(lambda: pe.forward(rows4), reps=3)

    def plant4():
        cache.clear()
        return plant(cache, pe, rows4, [STATE] * 4)

    R["batch4_plant_ms"] = timed(plant4, reps=3)
    R["batch4_plant_vs_plain"] = round(R["batch4_plant_ms"] / R["batch4_plain_packed_ms"], 4)
    log("4 states packed: plain", R["batch4_plain_packed_ms"], "ms, planting", R["batch4_plant_ms"], "ms")
    R["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    save()

    if args.f32:  # exactness on the GPU: float32 weights, the torch kernels (fla refuses float32)
        del cache, chunked, runner, pg, pe, a, h, h2
        gc.collect()
        torch.cuda.empty_cache()
        m32 = Qwen35(weights_from_state_dict(cfg, sd, letters, "cuda", torch.float32))
        tk = TorchKernels()
        r32 = ChunkRunner(m32, tk, max_pos=8192, max_slots=4, graphs=False)
        c32, k32 = StateCache(r32, settings), StateCache(r32, settings)
        plant(c32, PlainPath(m32, tk, graphs=False), [row], [STATE])
        k32.row(ids, STATE, row[1], row[2])
        R["states_f32"] = compare_states(c32, k32)
        log("float32 planted vs chunked states", json.dumps(R["states_f32"]))
        save()


def main():
    global OUT
    if torch.cuda.is_available():  # the compile caches the engine keeps (a carried copy serves these kernels too)
        from statecache.compile_cache import use_persistent_caches

        use_persistent_caches()
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shape", default="9B")
    ap.add_argument("--cache-mb", type=int, default=16384)
    ap.add_argument("--no-compile", action="store_true", help="eager elementwise pieces (default: compiled)")
    ap.add_argument("--lengths", default="4096,2432", help="state lengths for the planting graph against the plain graph")
    ap.add_argument("--graph-only", action="store_true",
                    help="only the plain graph and the planting graphs at --lengths (no packed, chunked or 4-state parts)")
    ap.add_argument("--f32", action="store_true", help="also compare the states in float32 (torch kernels)")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    R.update(shape=args.shape, gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        with torch.no_grad():
            bench(args)
    except Exception:  # noqa: BLE001
        R.setdefault("errors", []).append(traceback.format_exc()[-3000:])
        log(traceback.format_exc())
    save()
    log(json.dumps(R, indent=1))


if __name__ == "__main__":
    main()
