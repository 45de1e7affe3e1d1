"""Which chunk lengths to capture graphs for: padding of candidate bucket sets over the load trace's chunks (CPU).

    python bench/chunk_buckets.py [--agents 16] [--rows 3000] [--out DIR]

Replays bench/load_bench.py's agent trace through the cache's own chunk plan (`statecache.cache.index.plan_chunks`)
with an unbounded cache: a row restores the deepest planted checkpoint its tokens match, then runs chunks to each
planned end and the question as the last chunk. For each candidate set of chunk lengths: graphs to capture (chunk
lengths times attention spans), tokens padded over tokens run, and a GPU-weighted figure where a chunk costs
max(padded length, 128) tokens (below ~128 tokens a 9B chunk is bound by reading the weights, so padding there is
nearly free). Knows nothing of the device: pure arithmetic over the trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from load_bench import AgentTrace  # noqa: E402
from statecache.cache.index import plan_chunks  # noqa: E402

CANDIDATES = {
    "powers of two (16..2048)": (16, 32, 64, 128, 256, 512, 1024, 2048),
    "seed (15 sizes)": (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024, 1536, 2048),
    "64, 128, 256, 512, 1024, 1536, 2048": (64, 128, 256, 512, 1024, 1536, 2048),
    "64, 128, 192, 256, 384, 512, 1024, 1536, 2048": (64, 128, 192, 256, 384, 512, 1024, 1536, 2048),
    "32, 64, 128, 256, 512, 1024, 2048": (32, 64, 128, 256, 512, 1024, 2048),
    "64, 128, 256, 512, 1024, 2048": (64, 128, 256, 512, 1024, 2048),
    "64, 160, 256, 512, 1024, 1536, 2048": (64, 160, 256, 512, 1024, 1536, 2048),
    "64, 128, 256, 512, 768, 1024, 1536, 2048": (64, 128, 256, 512, 768, 1024, 1536, 2048),
    "64, 128, 256, 512, 1024, 1536, 1792, 2048": (64, 128, 256, 512, 1024, 1536, 1792, 2048),
    "64, 128, 256, 512, 1024, 1280, 1536, 1792, 2048": (64, 128, 256, 512, 1024, 1280, 1536, 1792, 2048),
}


def trace_chunks(agents: int, rows: int, seed: int = 0, stride: int = 2048, tail: int = 16, align: int = 64,
                 max_chunk: int = 2048) -> list[tuple[int, int]]:
    """(chunk length, chunk end) of every chunk the trace's rows run with an unbounded cache."""
    tr = AgentTrace(agents, seed, (1000, 248320))
    planted: dict[int, dict[int, set[bytes]]] = {}  # agent -> position -> prefixes (as bytes of their tokens)
    out = []
    import numpy as np

    for r in tr.interleaved(rows):
        ids = np.asarray(r.ids, dtype=np.int64)
        p = r.state_len - r.state_len % align
        mine = planted.setdefault(r.agent, {})
        c = max((pos for pos, pre in mine.items() if pos <= p and ids[:pos].tobytes() in pre), default=0)
        ends = plan_chunks(c, r.state_len, stride=stride, tail=tail, align=align, max_chunk=max_chunk)
        s = c
        for e in ends:
            out.append((e - s, e))
            mine.setdefault(e, set()).add(ids[:e].tobytes())
            s = e
        out.append((len(r.ids) - p, len(r.ids)))  # the question chunk
    return out


def score(chunks, sizes, spans=tuple(range(1024, 8193, 1024))) -> dict:
    real = sum(n for n, _ in chunks)
    padded = gpu = 0
    used = set()
    for n, end in chunks:
        b = next(x for x in sizes if n <= x)
        padded += b
        gpu += max(b, 128)
        used.add(b)
    graphs = sum(1 for P in spans for L in sizes if L <= P)
    return {"sizes": list(sizes), "graphs": graphs, "padding": round(padded / real - 1, 4),
            "gpu_weighted_vs_real": round(gpu / sum(max(n, 128) for n, _ in chunks) - 1, 4), "sizes_used": len(used)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    chunks = trace_chunks(args.agents, args.rows)
    lengths = sorted(n for n, _ in chunks)
    q = lambda f: lengths[int(f * (len(lengths) - 1))]  # noqa: E731
    print(f"{len(chunks)} chunks over {args.rows} rows; length p10 {q(.1)}, p50 {q(.5)}, p90 {q(.9)}, max {lengths[-1]}")
    res = {name: score(chunks, sizes) for name, sizes in CANDIDATES.items()}
    print(f"{'candidate':<48} graphs  padding  GPU-weighted")
    for name, r in res.items():
        print(f"{name:<48} {r['graphs']:6d}  {100 * r['padding']:6.1f}%  {100 * r['gpu_weighted_vs_real']:6.1f}%")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "chunk_buckets.json").write_text(json.dumps({"chunks": len(chunks), "candidates": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
