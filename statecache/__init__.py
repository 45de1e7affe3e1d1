"""statecache: answers AI agents' multiple-choice questions with a hybrid Qwen3.5 model, continuing each request
from the deepest saved model state it shares with earlier ones (see README.md and docs/ARCHITECTURE.md)."""

__version__ = "0.1.0"
