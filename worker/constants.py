"""Every name and default the worker and its producers share: queue, job names, Redis keys, settings.

Like arq's own constants module: plain values only, no imports of the rest of the project, so the agent-side
library (`producer`) can use them without loading the worker. Units are in the names.
"""

# Queue and jobs
QUEUE_NAME = "statecache:queue"  # arq's sorted set of job ids
HEALTH_KEY_SUFFIX = ":health-check"  # arq's: the worker refreshes QUEUE_NAME + this while it runs
JOB_ANSWER = "answer"  # one row in, one result out
JOB_STATS = "stats"  # the engine's and the worker's counters
DONE_CHANNEL_SUFFIX = ":done"  # pub/sub channel QUEUE_NAME + this: job ids published once their result is stored

# Environment (DESIGN.md section 7, plus the service's own knobs)
ENV_REDIS_URL = "REDIS_URL"
ENV_QUEUE = "STATECACHE_QUEUE"
ENV_BACKLOG_ROWS = "STATECACHE_BACKLOG_ROWS"
ENV_MAX_ROW_TOKENS = "STATECACHE_MAX_ROW_TOKENS"
ENV_MAX_JOBS = "STATECACHE_MAX_JOBS"
ENV_POLL_DELAY_S = "STATECACHE_POLL_DELAY_S"
ENV_JOB_TIMEOUT_S = "STATECACHE_JOB_TIMEOUT_S"
ENV_DRAIN_S = "STATECACHE_DRAIN_S"
ENV_HEALTH_INTERVAL_S = "STATECACHE_HEALTH_INTERVAL_S"
ENV_ENGINE = "STATECACHE_ENGINE"  # "module:callable" that builds the engine; the default reads STATECACHE_MODEL etc.
# read by the engine itself: STATECACHE_MODEL, STATECACHE_DEVICE, STATECACHE_DTYPE, STATECACHE_CACHE_MB

# Defaults
REDIS_URL = "redis://localhost:6379/0"
ENGINE = "statecache.engine:Engine.from_env"
BACKLOG_ROWS = 8  # more rows waiting than this = backed up: one plain batch would not absorb them
BACKLOG_READ_EVERY_S = 0.02  # the Redis backlog (ZCOUNT of ready jobs) is read at most this often
MAX_JOBS = 256  # jobs one worker holds at once: all of them can wait on the GPU thread, so it sees a batch
POLL_DELAY_S = 0.01  # arq polls the queue this often (its default, 0.5 s, would dominate a hit's latency)
JOB_TIMEOUT_S = 120.0  # a job (waiting for the GPU thread included) is cancelled and retried after this
KEEP_RESULT_S = 600.0  # results stay in Redis this long for the producer to read
MAX_TRIES = 5  # a job cancelled (shutdown) or lost (killed worker) is run again up to this many times
DRAIN_S = 30.0  # on SIGTERM: stop taking jobs, wait this long for in-flight rows, then cancel (they re-queue)
HEALTH_INTERVAL_S = 5.0  # the health key is refreshed this often and lives this long plus 1 s
GPU_STOP_WAIT_S = 10.0  # at shutdown, wait this long for the GPU thread's current batch
MAX_BATCH_ROWS = 1024  # at most this many rows in one engine call

# Producer defaults
ANSWER_TIMEOUT_S = 60.0  # a producer gives up on an answer after this (and the job expires with it)
RESULT_POLL_S = 0.1  # fallback poll for a result when its done message was missed
