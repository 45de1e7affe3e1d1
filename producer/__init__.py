"""The agent side of statecache: the msgpack serialiser pair (from statecache.protocol, for a plain arq pool),
`Client` (answer rows through Redis, with retries through an outage), a CLI that sends rows from a JSON-lines
file, and a demo of simulated agents (`statecache-demo`, `python -m producer.demo`).

    from arq import create_pool
    from producer import arq_settings, serialize, deserialize

    pool = await create_pool(arq_settings("redis://localhost:6379/0"), job_serializer=serialize, job_deserializer=deserialize)
    job = await pool.enqueue_job("answer", row)
    result = await job.result()
"""

from statecache.protocol import ERROR_CODES, JOB_ANSWER, QUEUE_NAME, RemoteJobError, deserialize, serialize
from statecache.redis_url import BadRedisURL, arq_settings
from producer.client import AnswerTimeout, Client, ClientError, QueueError, QueueFull, QueueRefused, QueueUnavailable
from producer.client import RowRejected, WorkerError

__all__ = ["serialize", "deserialize", "RemoteJobError", "JOB_ANSWER", "QUEUE_NAME", "ERROR_CODES", "arq_settings",
           "BadRedisURL", "Client", "ClientError", "AnswerTimeout", "QueueUnavailable", "QueueRefused", "QueueError",
           "QueueFull", "RowRejected", "WorkerError"]
