"""Row contract checks (the schema is in statecache.protocol): a row from the queue in, a validated row or a
clear error out.

Knows the row's shape only: token rows (`ids`, `state_len`, `slots`, `nopts`) and text rows (`state`,
`questions`), either with optional `images` (checked by statecache.images, which `check_row` hands them to).
Does not know the model beyond its vocabulary size, nor the tokenizer (text rows are turned into token rows by
`statecache.text`), nor the queue. No torch: the checks over a row's ids run as C loops (a set of the element
types, numpy's min and max), ~0.1 ms for 4k ids (bench/host_path.py).

Rows arrive through msgpack, so anything may come: bools where ints belong (bool is an int in Python, so it
is rejected by type, not by value), floats, strings, nested junk. Every problem becomes a `RowError` with a
short snake_case `code` and a message that names the field and the bad value.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .protocol import error_result  # noqa: F401 - the result a bad row gets (re-exported for the engine)

MIN_OPTIONS = 2
MAX_OPTIONS = 26  # letters A..Z
TOKEN_FIELDS = ("ids", "state_len", "slots", "nopts")
TEXT_FIELDS = ("state", "questions")
OPTIONAL_FIELDS = ("images",)  # either form (statecache.images)


class RowError(Exception):
    """A malformed row. `code` is short snake_case, `message` says what and where."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def is_text_row(row: Any) -> bool:
    """A map that carries the text form (`state` / `questions`) and no token ids."""
    return isinstance(row, dict) and "ids" not in row and any(k in row for k in TEXT_FIELDS)


def _show(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_fields(row: Any, fields: tuple[str, ...], form: str, optional: tuple[str, ...] = OPTIONAL_FIELDS) -> None:
    if not isinstance(row, dict):
        raise RowError("bad_row", f"a row must be a map, got {type(row).__name__}")
    missing = [k for k in fields if k not in row]
    if missing:
        raise RowError("bad_row", f"{form} row is missing {', '.join(missing)}")
    extra = sorted(str(k) for k in row if k not in fields and k not in optional)
    if extra:
        raise RowError("bad_row", f"{form} row has unknown field(s) {', '.join(extra)}; expected {', '.join(fields)}")


def _int(value: Any, where: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise RowError("bad_type", f"{where} must be an int, got {type(value).__name__} {_show(value)}")
    return int(value.__index__())  # numpy / torch integer scalars from in-process callers


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise RowError("bad_type", f"{where} must be a list of ints, got {type(value).__name__}")
    if set(map(type, value)) <= _INT:  # the fast path (C loops only): what msgpack delivers for a good row
        return list(value)
    return [_int(x, f"{where}[{i}]") for i, x in enumerate(value)]


_INT = {int}


def _id_range(ids: list[int]) -> tuple[int, int]:
    """min and max of the ids, over an int64 array when they fit in one (a C loop), else in Python."""
    try:
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    except OverflowError:
        return min(ids), max(ids)
    return int(arr.min()), int(arr.max())


def check_token_row(row: Any, vocab_size: int, max_tokens: int) -> dict:
    """A validated, normalised copy of a token row; raises RowError for anything malformed."""
    check_fields(row, TOKEN_FIELDS, "token")
    ids = _int_list(row["ids"], "ids")
    state_len = _int(row["state_len"], "state_len")
    slots = _int_list(row["slots"], "slots")
    nopts = _int_list(row["nopts"], "nopts")
    n = len(ids)
    if n == 0:
        raise RowError("empty", "ids is empty")
    if n > max_tokens:
        raise RowError("too_long", f"row has {n} tokens, more than the limit {max_tokens}")
    lo, hi = _id_range(ids)
    if lo < 0 or hi >= vocab_size:
        i = next(i for i, x in enumerate(ids) if x < 0 or x >= vocab_size)
        raise RowError("id_out_of_range", f"ids[{i}] = {ids[i]} is outside [0, {vocab_size})")
    if not 0 <= state_len <= n:
        raise RowError("state_len_out_of_range", f"state_len = {state_len} is outside [0, {n}] (len(ids) = {n})")
    if not slots:
        raise RowError("empty", "slots is empty: a row needs at least one answer slot")
    if len(nopts) != len(slots):
        raise RowError("length_mismatch", f"{len(slots)} slots but {len(nopts)} nopts: one nopts per slot")
    for i, s in enumerate(slots):
        if not 0 <= s < n:
            raise RowError("slot_out_of_range", f"slots[{i}] = {s} is outside [0, {n}) (len(ids) = {n})")
    for i, k in enumerate(nopts):
        if not MIN_OPTIONS <= k <= MAX_OPTIONS:
            raise RowError("bad_nopts", f"nopts[{i}] = {k} is outside {MIN_OPTIONS}..{MAX_OPTIONS}")
    return {"ids": ids, "state_len": state_len, "slots": slots, "nopts": nopts}


def check_row(row: Any, vocab_size: int, max_tokens: int, tokenizer: Any = None, images: Any = None) -> dict:
    """Either form in, a validated token row out (text rows are tokenised with `tokenizer`). A row with `images`
    needs `images` (the model's statecache.images.ImageSupport) and comes out with `images`: its located ImageRefs."""
    if isinstance(row, dict) and "ids" in row and any(k in row for k in TEXT_FIELDS):
        raise RowError("bad_row", "a row is either a token row (ids, ...) or a text row (state, questions), not both")
    has_images = isinstance(row, dict) and row.get("images") not in (None, [], ())
    if has_images and images is None:
        raise RowError("no_vision", "this row has images but the model has no vision tower (or no image processor)")
    if is_text_row(row):
        if tokenizer is None:
            raise RowError("bad_row", "text rows need a tokenizer; this caller has none")
        from statecache.text import encode_text_row

        row = encode_text_row(row, tokenizer, max_tokens, images)
        refs = row.pop("images", None)
    else:
        refs = images.prepare(row["images"]) if has_images else None
        if isinstance(row, dict) and "images" in row:
            row = {k: v for k, v in row.items() if k != "images"}
    out = check_token_row(row, vocab_size, max_tokens)
    if refs:
        from statecache.images import locate

        out["images"] = locate(out["ids"], refs, images.image_token_id)
    return out
