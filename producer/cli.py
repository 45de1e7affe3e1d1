"""Send rows from a JSON-lines file to the statecache worker; write one JSON result per line, in input order.

    python -m producer.cli rows.jsonl [-o results.jsonl] [--redis-url URL] [--queue NAME] [--concurrency 32]

Each input line is one row (token form or text form, statecache.protocol); `-` reads stdin. Each output line
is the worker's result, or `{"error": {"code", "message"}}` for a refused row, a line that is not JSON, a
timeout, a failed job or a Redis error (`queue_error`: Redis full, read-only, ...). Exit status: 0 if every row was answered, 1 if any got an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from producer.client import AnswerTimeout, Client, QueueError, RowRejected, WorkerError
from statecache.protocol import error_result
from statecache.settings import Settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = Settings.from_env(warn_unknown=False)
    p = argparse.ArgumentParser(prog="python -m producer.cli", description=__doc__.split("\n\n")[0])
    p.add_argument("rows", help="JSON-lines file of rows, or - for stdin")
    p.add_argument("-o", "--output", default="-", help="where to write results (default: stdout)")
    p.add_argument("--redis-url", default=env.redis_url, help="default: $REDIS_URL")
    p.add_argument("--queue", default=env.queue, help="default: $STATECACHE_QUEUE, else arq's default queue")
    p.add_argument("--concurrency", type=int, default=32, help="rows in flight at once")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="per row (default: long enough for a row to run again after a killed worker: the Client's)")
    return p.parse_args(argv)


def read_rows(path: str) -> list:
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with f:
        rows = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(error_result("bad_json", f"line {n}: {e}"))
        return rows


async def answer_all(client: Client, rows: list, concurrency: int, timeout_s: float) -> list[dict]:
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(row) -> dict:
        if isinstance(row, dict) and set(row) == {"error"}:
            return row  # a line that was not JSON
        async with gate:
            try:
                return await client.answer(row, timeout_s)
            except RowRejected as e:
                return error_result(e.code, e.message)
            except AnswerTimeout as e:
                return error_result("timeout", str(e))
            except WorkerError as e:
                return error_result("job_failed", str(e))
            except QueueError as e:
                return error_result("queue_error", str(e))

    return await asyncio.gather(*[one(r) for r in rows])


async def run(args: argparse.Namespace) -> int:
    rows = read_rows(args.rows)
    t0 = time.perf_counter()
    async with await Client.connect(args.redis_url, args.queue, args.timeout_s) as client:
        results = await answer_all(client, rows, args.concurrency, args.timeout_s)
    elapsed = time.perf_counter() - t0
    text = "".join(json.dumps(result) + "\n" for result in results)
    if args.output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text)
    errors = sum("error" in r for r in results)
    print(f"{len(results)} rows, {errors} errors, {elapsed:.2f} s", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
