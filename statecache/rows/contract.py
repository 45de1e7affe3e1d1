"""The row contract's shared vocabulary: its fields, the bounds on options, `RowError` and the fields check.

statecache.rows.check (token rows, and `check_row`, which hands text rows to statecache.rows.text and images to
statecache.rows.images), statecache.rows.text and statecache.rows.images all build on this module; it imports none of them.
Knows the field names only, not their values' checks (those live with each form).
"""

from __future__ import annotations

import re
from typing import Any

MIN_OPTIONS = 2
MAX_OPTIONS = 26  # letters A..Z
TOKEN_FIELDS = ("ids", "state_len", "slots")  # and one of OPTION_FIELDS
OPTION_FIELDS = ("nopts", "options")  # per slot: an option count (the first letters), or the option token ids
TEXT_FIELDS = ("state", "questions")
OPTIONAL_FIELDS = ("images",)  # either form (statecache.rows.images)


class RowError(Exception):
    """A malformed row. `code` is short snake_case, `message` says what and where."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")


def type_name(value: Any) -> str:
    """The plain type a value arrived as (a worker's quiet wrappers of lists and strings read as list and str)."""
    return next((t.__name__ for t in (bool, int, float, str, bytes, list, tuple, dict) if isinstance(value, t)),
                type(value).__name__)


def field_names(keys: Any) -> str:
    """Unknown keys for a message: the ones that look like field names, and how many others (not echoed)."""
    names = sorted(k for k in map(str, keys) if _NAME.fullmatch(k))
    others = len(list(keys)) - len(names)
    return ", ".join(names + ([f"{others} other key(s)"] if others else []))


def check_fields(row: Any, fields: tuple[str, ...], form: str, optional: tuple[str, ...] = OPTIONAL_FIELDS) -> None:
    if not isinstance(row, dict):
        raise RowError("bad_row", f"a row must be a map, got {type_name(row)}")
    missing = [k for k in fields if k not in row]
    if missing:
        raise RowError("bad_row", f"{form} row is missing {', '.join(missing)}")
    extra = [k for k in row if k not in fields and k not in optional]
    if extra:
        raise RowError("bad_row", f"{form} row has unknown field(s) {field_names(extra)}; expected {', '.join(fields)}")
