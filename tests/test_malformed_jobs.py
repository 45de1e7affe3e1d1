"""Hand-written jobs in Redis (issue 23, items 1, 3 and 9): the real worker, real Redis, the tiny model. Every
field arq reads from a job is checked before arq touches it, a payload's decoded size is bounded before it is
decoded, and no row content reaches the log at INFO or a stored error message."""

import asyncio
import logging
import math
import pickle
import resource
import uuid

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job

from statecache.engine import Engine
from statecache.protocol import JOB_KEY_PREFIX, MAX_JOB_VALUES, JobTooComplex, check_job_shape, decode_job, deserialize, serialize
from tests.harness import InProcessWorker

SECRET = "PAGE-SECRET-7f3a"


def row(state: int, q: int = 0, n: int = 40) -> dict:
    return {"ids": [state] * n + [10 + q], "state_len": n, "slots": [n], "nopts": [3]}


@pytest.fixture(scope="module")
def engine():
    return Engine()


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD = row(3)
NOW = 1_700_000_000_000


def job(**over) -> dict:
    return {"f": "answer", "a": [GOOD], "k": {}, "t": 1, "et": NOW, **over}


def malformed() -> list[bytes]:
    """Every field arq reads, every wrong type: 40+ payloads."""
    jobs = []
    for et in ("yesterday", math.nan, math.inf, -math.inf, 2**63 - 1, 2**64 - 1, -1, [NOW], {"x": 1}, None, True, b"t"):
        jobs.append(job(et=et))
    for t in ("1", [1], {"t": 1}, 1.5, math.nan, -1, 2**63 - 1, True, b"1"):
        jobs.append(job(t=t))
    for f in (1, None, ["answer"], "", "x" * 500, "answer\nforged log line", b"answer", {"f": "answer"}):
        jobs.append(job(f=f))
    for a in ("row", 7, None, {"ids": [1]}, b"ab"):
        jobs.append(job(a=a))
    for k in ([], "k", 3, {1: 2}, {"not an identifier": 1}, {"x" * 100: 1}):
        jobs.append(job(k=k))
    for field in ("f", "a", "k", "t", "et"):
        jobs.append({key: v for key, v in job().items() if key != field})
    jobs += [job(a=[[{}] * 100_000] * 3), job(a=[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), job(a=[["s"] * 300_000])]
    out = [pack(j) for j in jobs]
    out += [pack([1, 2, 3]), pack("answer"), pack(None), pickle.dumps(job()), b"\xc1garbage", b"", b"\x93\x01",
            pack(msgpack.ExtType(1, pack([[0] * 50, "x"]))), pack(job(a=[msgpack.ExtType(9, b"zz")]))]
    return out


async def bad_job_results(pool, queue: str, payloads: list[bytes]) -> list:
    ids = []
    for data in payloads:
        job_id = f"bad-{uuid.uuid4().hex[:10]}"
        await pool.set(JOB_KEY_PREFIX + job_id, data)
        await pool.zadd(queue, {job_id: NOW})
        ids.append(job_id)
    out = []
    for job_id in ids:
        try:
            out.append(await Job(job_id, pool, queue, _deserializer=deserialize).result(timeout=60, poll_delay=0.02))
        except Exception as e:  # noqa: BLE001 - a failed job: its exception
            out.append(e)
    return out


def test_malformed_jobs_while_agents_send_good_rows(redis_url, queue_name, engine, caplog):
    """Issue 23's must-show: 40+ malformed jobs written by hand (arq:job:<id> + ZADD) while 4 agents send good rows
    through the bare arq pool: the worker never exits, every good row is answered right, every bad job fails with a
    message."""
    payloads = malformed()
    assert len(payloads) >= 40
    want = {(a, q): r["probs"] for (a, q), r in zip([(a, q) for a in range(4) for q in range(4)],
                                                    Engine().answer([row(20 + a, q) for a in range(4) for q in range(4)]))}
    w = InProcessWorker(redis_url, queue_name, lambda: engine)
    with w:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)

            async def agent(a: int):
                got = {}
                for q in range(4):
                    j = await pool.enqueue_job("answer", row(20 + a, q))
                    got[(a, q)] = (await j.result(timeout=60, poll_delay=0.01))["probs"]
                return got

            try:
                results = await asyncio.gather(bad_job_results(pool, queue_name, payloads), *[agent(a) for a in range(4)])
            finally:
                await pool.aclose(close_connection_pool=True)
            return results

        bad, *good = asyncio.run(main())
        assert w.error is None and w._thread.is_alive()
    assert w.error is None, w.error_trace
    answered = {k: v for g in good for k, v in g.items()}
    assert answered.keys() == want.keys()
    for key, probs in want.items():
        assert all(abs(x - y) < 1e-4 for x, y in zip(answered[key][0], probs[0]))
    for data, result in zip(payloads, bad):
        if isinstance(result, dict):  # an error result (job_too_large)
            assert result["error"]["code"] == "job_too_large" and result["error"]["message"], data[:40]
        else:
            assert str(result), data[:40]


def test_a_payload_under_the_byte_limit_is_bounded_before_decoding():
    """[{}] * 15M is 14.3 MiB of msgpack: refused by its array header, before any object exists (RSS stays put); a
    good row of the engine's largest size (32768 tokens, a slot on every one) still decodes."""
    data = pack({"ids": [{}] * 15_000_000, "state_len": 1, "slots": [0], "nopts": [2]})
    assert len(data) < 16 * 2**20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="more than"):
        decode_job(data)
    nested = pack({"a": [[{}] * 60_000] * 250})  # many arrays, each under any per-array limit
    with pytest.raises(ValueError, match="more than"):
        decode_job(nested)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
    n = Engine().max_row_tokens
    big = job(a=[{"ids": [5] * n, "state_len": 1, "slots": list(range(n)), "nopts": [2] * n}])
    assert decode_job(pack(big)) == big
    assert 3 * n < MAX_JOB_VALUES


def test_no_row_content_in_logs_or_error_messages(redis_url, queue_name, engine, caplog):
    """arq logs every job's arguments and every result at INFO: with the worker's decoding, the log holds ids and
    sizes only; an error message names the field and the rule, not the value."""
    with caplog.at_level(logging.INFO):
        with InProcessWorker(redis_url, queue_name, lambda: engine):

            async def main():
                pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                         job_deserializer=deserialize, default_queue_name=queue_name)
                try:
                    out = []
                    for r in ([SECRET, 1, 2], SECRET, {**row(3), "state_len": SECRET}, {**row(3), SECRET: 1},
                              {"state": SECRET, "questions": [{"text": SECRET, "options": [SECRET, "b"], SECRET: 1}]},
                              row(4)):
                        out.append(await (await pool.enqueue_job("answer", r)).result(timeout=60, poll_delay=0.01))
                    return out
                finally:
                    await pool.aclose(close_connection_pool=True)

            results = asyncio.run(main())
    assert all("error" in r for r in results[:-1]) and "probs" in results[-1]
    assert not any(SECRET in r["error"]["message"] for r in results[:-1])
    probs = results[-1]["probs"][0]
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "answer(" in text  # the job-start lines were logged
    assert SECRET not in text and "SECRET" not in text
    assert not any(f"{p:.4f}"[:6] in text for p in probs)  # no result (probabilities) at INFO


def test_queue_entries_written_by_hand(redis_url, queue_name, engine):
    """The queue's own fields, read by arq outside any job: a member that is not UTF-8 is removed, a score of -inf
    runs as the oldest job; the worker goes on."""
    w = InProcessWorker(redis_url, queue_name, lambda: engine)
    with w:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            try:
                await pool.zadd(queue_name, {b"\xff\xfe": NOW})
                await pool.set(JOB_KEY_PREFIX + "minus-inf", pack(job(a=[row(5)])))
                await pool.zadd(queue_name, {"minus-inf": -math.inf})
                first = await Job("minus-inf", pool, queue_name, _deserializer=deserialize).result(timeout=30, poll_delay=0.02)
                after = await (await pool.enqueue_job("answer", row(6))).result(timeout=30, poll_delay=0.01)
                return first, after, await pool.zscore(queue_name, b"\xff\xfe")
            finally:
                await pool.aclose(close_connection_pool=True)

        first, after, odd = asyncio.run(main())
        assert w.error is None and w._thread.is_alive()
    assert "probs" in first and "probs" in after and odd is None


def _shape(o, depth=0):
    """(values, depth) of a decoded object, the way check_job_shape counts them."""
    if isinstance(o, (list, dict)):
        items = list(o) if isinstance(o, list) else [x for kv in o.items() for x in kv]
        sub = [_shape(x, depth + 1) for x in items]
        return len(items) + sum(v for v, _ in sub), max([depth + 1] + [d for _, d in sub])
    return 0, depth


_leaf = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=40)
         | st.binary(max_size=300) | st.just([]) | st.just({}))
_tree = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=3), inner,
                                                                                           max_size=5), max_leaves=80)


@settings(max_examples=300, deadline=None)
@given(_tree)
def test_the_shape_check_counts_what_the_decoder_builds(obj):
    data = pack(obj)
    values, depth = _shape(msgpack.unpackb(data, raw=False, strict_map_key=False))
    check_job_shape(data, values, depth)  # exactly at the limits: accepted
    if values:
        with pytest.raises(JobTooComplex):
            check_job_shape(data, values - 1, depth)
    if depth:
        with pytest.raises(JobTooComplex):
            check_job_shape(data, values, depth - 1)


def test_a_job_key_of_another_redis_type_fails_that_job_only(redis_url, queue_name, engine):
    """Issue 32, 2: a hash at arq:job:<id> (the id on the queue) read in the dispatcher's pipeline raised WRONGTYPE for
    the whole round, on every round: 0 of 8 good rows answered. Now it is one failed job; the 8 are answered."""
    w = InProcessWorker(redis_url, queue_name, lambda: engine)
    with w:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            try:
                await pool.hset(JOB_KEY_PREFIX + "hash-job", mapping={"f": "answer"})
                await pool.zadd(queue_name, {"hash-job": 1000})  # the oldest: first in every dispatch round
                jobs = [await pool.enqueue_job("answer", row(40 + i)) for i in range(8)]
                good = [await j.result(timeout=40, poll_delay=0.02) for j in jobs]
                try:
                    bad = await Job("hash-job", pool, queue_name, _deserializer=deserialize).result(timeout=30, poll_delay=0.02)
                except Exception as e:  # noqa: BLE001 - the failed job's exception
                    bad = e
                return good, bad
            finally:
                await pool.aclose(close_connection_pool=True)

        good, bad = asyncio.run(main())
        assert w.error is None and w._thread.is_alive()
    assert all("probs" in g for g in good), good
    assert not isinstance(bad, dict) and "could not be used" in str(bad), bad


def test_a_job_id_with_control_characters_is_logged_escaped(redis_url, queue_name, engine, caplog):
    """Issue 32, 8: a producer names any job id; one with a newline was logged raw (a forged log line)."""
    caplog.set_level(logging.INFO)
    evil = "evil\nFORGED statecache worker ready\x1b[2J"
    w = InProcessWorker(redis_url, queue_name, lambda: engine)
    with w:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            try:
                return await (await pool.enqueue_job("answer", row(50), _job_id=evil)).result(timeout=30, poll_delay=0.02)
            finally:
                await pool.aclose(close_connection_pool=True)

        result = asyncio.run(main())
    assert "probs" in result
    lines = [r.getMessage() for r in caplog.records]
    named = [m for m in lines if "evil" in m]
    assert named and all("evil\\nFORGED" in m and "\n" not in m and "\x1b" not in m for m in named), named


def test_a_job_with_queue_score_zero_runs(redis_url, queue_name, engine):
    """Issue 32, 8: arq skips a job whose queue score is 0 (it tests the score for truth): written by hand with score
    0, it sat on a worker's private queue until a SIGTERM handed it back. It runs as the oldest job now."""
    w = InProcessWorker(redis_url, queue_name, lambda: engine)
    with w:

        async def main():
            pool = await create_pool(RedisSettings.from_dsn(redis_url), job_serializer=serialize,
                                     job_deserializer=deserialize, default_queue_name=queue_name)
            try:
                await pool.set(JOB_KEY_PREFIX + "score-zero", pack(job(a=[row(51)])))
                await pool.zadd(queue_name, {"score-zero": 0})
                return await Job("score-zero", pool, queue_name, _deserializer=deserialize).result(timeout=20, poll_delay=0.02)
            finally:
                await pool.aclose(close_connection_pool=True)

        result = asyncio.run(main())
        assert w.error is None
    assert "probs" in result
