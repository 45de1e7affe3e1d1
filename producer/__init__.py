"""The agent side of statecache: `Client` (answer rows through Redis), the msgpack serialiser pair, a CLI
that sends rows from a JSON-lines file, and a demo of simulated agents (`python -m producer.demo`)."""

from producer.client import AnswerTimeout, Client, RowRejected, WorkerError
from producer.serial import RemoteJobError, deserialize, serialize

__all__ = ["Client", "AnswerTimeout", "RowRejected", "WorkerError", "RemoteJobError", "serialize", "deserialize"]
