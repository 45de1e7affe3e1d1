"""Row contract checks (the schema is in statecache.protocol): a row from the queue in, a validated row or a
clear error out.

Knows the row's shape only: token rows (`ids`, `state_len`, `slots`, and `nopts` or `options`) and text rows (`state`,
`questions`), either with optional `images` (checked by statecache.rows.images, which `check_row` hands them to); the
fields, the option bounds and `RowError` are statecache.rows.contract's, shared with statecache.rows.text and statecache.rows.images.
Does not know the model beyond its vocabulary size, nor the tokenizer (text rows are turned into token rows by
`statecache.rows.text`), nor the queue. No torch: the checks over a row's ids run as C loops (a set of the element
types, numpy's min and max), ~0.1 ms for 4k ids (bench/host_path.py); with `as_array` (the engine's) one conversion
to int64 does the type check too and the row keeps the array.

Rows arrive through msgpack, so anything may come: bools where ints belong (bool is an int in Python, so it
is rejected by type, not by value), floats, strings, nested junk. Every problem becomes a `RowError` with a
short snake_case `code` and a message that names the field (and the position) and the rule, never the value: a
message is stored with the result and may be logged, and a row's content belongs in neither.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from statecache.rows.contract import (MAX_OPTIONS, MIN_OPTIONS, OPTION_FIELDS, OPTIONAL_FIELDS, TEXT_FIELDS, TOKEN_FIELDS,
                                      RowError, check_fields, type_name)


def is_text_row(row: Any) -> bool:
    """A map that carries the text form (`state` / `questions`) and no token ids."""
    return isinstance(row, dict) and "ids" not in row and any(k in row for k in TEXT_FIELDS)


def _int(value: Any, where: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise RowError("bad_type", f"{where} must be an int, got {type_name(value)}")
    return int(value.__index__())  # numpy / torch integer scalars from in-process callers


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise RowError("bad_type", f"{where} must be a list of ints, got {type_name(value)}")
    if set(map(type, value)) <= _INT:  # the fast path (C loops only): what msgpack delivers for a good row
        return list(value)
    return [_int(x, f"{where}[{i}]") for i, x in enumerate(value)]


_INT = {int}


def _id_array(value: list | tuple) -> np.ndarray | None:
    """The ids as an int64 array when every one is an int (or an integer scalar) that fits and none is a bool (one C
    loop, ~85 us for 4k ids, and a look at the few ids that are 0 or 1); None otherwise (the caller then checks them
    one by one, as `_int_list` does, for the exact error)."""
    try:
        arr = np.frombuffer(array("q", value), dtype=np.int64)  # refuses floats, strings, None, huge ints
    except (TypeError, OverflowError, ValueError):
        return None
    small = np.flatnonzero(arr <= 1)  # a bool went in as 0 or 1 (bool is an int): look at those only
    if small.size and any(type(value[i]) is bool for i in small.tolist()):
        return None
    return arr


def _id_range(ids: list[int]) -> tuple[int, int]:
    """min and max of the ids, over an int64 array when they fit in one (a C loop), else in Python."""
    try:
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    except OverflowError:
        return min(ids), max(ids)
    return int(arr.min()), int(arr.max())


def check_token_row(row: Any, vocab_size: int, max_tokens: int, as_array: bool = False) -> dict:
    """A validated, normalised copy of a token row; raises RowError for anything malformed. as_array: `ids` comes
    out as a read-only int64 numpy array (what the engine works on: memo keys, grouping, index lookups and packing
    read it without a Python loop) instead of a list of ints."""
    check_fields(row, TOKEN_FIELDS, "token", OPTIONAL_FIELDS + OPTION_FIELDS)
    if not any(k in row for k in OPTION_FIELDS):
        raise RowError("bad_row", "token row is missing nopts (or options): the options of each slot")
    arr = _id_array(row["ids"]) if as_array and isinstance(row["ids"], (list, tuple)) else None
    ids = arr if arr is not None else _int_list(row["ids"], "ids")
    state_len = _int(row["state_len"], "state_len")
    slots = _int_list(row["slots"], "slots")
    nopts = _int_list(row["nopts"], "nopts") if "nopts" in row else None
    n = len(ids)
    if n == 0:
        raise RowError("empty", "ids is empty")
    if n > max_tokens:
        raise RowError("too_long", f"row has {n} tokens, more than the limit {max_tokens}")
    lo, hi = (int(arr.min()), int(arr.max())) if arr is not None else _id_range(ids)
    if lo < 0 or hi >= vocab_size:
        i = next(i for i, x in enumerate(ids) if x < 0 or x >= vocab_size)
        raise RowError("id_out_of_range", f"ids[{i}] is outside [0, {vocab_size}) (the model's vocabulary)")
    if not 0 <= state_len <= n:
        raise RowError("state_len_out_of_range", f"state_len is outside [0, {n}] (len(ids) = {n})")
    if not slots:
        raise RowError("empty", "slots is empty: a row needs at least one answer slot")
    if nopts is not None and len(nopts) != len(slots):
        raise RowError("length_mismatch", f"{len(slots)} slots but {len(nopts)} nopts: one nopts per slot")
    for i, s in enumerate(slots):
        if not 0 <= s < n:
            raise RowError("slot_out_of_range", f"slots[{i}] is outside [0, {n}) (len(ids) = {n})")
    for i, k in enumerate(nopts or ()):
        if not MIN_OPTIONS <= k <= MAX_OPTIONS:
            raise RowError("bad_nopts", f"nopts[{i}] is outside {MIN_OPTIONS}..{MAX_OPTIONS}")
    options = nopts if "options" not in row else _options(row["options"], len(slots), vocab_size, nopts)
    if as_array:
        if arr is None:  # checked one by one: every id is an int in [0, vocab_size) now
            arr = np.array(ids, dtype=np.int64)
        arr.setflags(write=False)
        ids = arr
    return {"ids": ids, "state_len": state_len, "slots": slots, "options": options}


@dataclass(frozen=True)
class CheckedRow:
    """A row checked (a text row tokenised) by `check_row` away from the engine's thread (statecache.engine's
    `Engine.check_aside`): the validated row, or the RowError's (code, message); `limits` (vocab_size, max_tokens)
    it was checked under. The engine takes it as it is while its limits are the same (else it checks `raw` again).
    Made in-process only: a row from the queue is never one."""

    row: dict | None
    error: tuple[str, str] | None
    limits: tuple[int, int]
    raw: Any = None


def _options(value: Any, n_slots: int, vocab_size: int, nopts: list[int] | None) -> list:
    """A token row's `options`: per slot a list of MIN_OPTIONS..MAX_OPTIONS distinct token ids in [0, vocab_size)
    -> per slot a tuple of ints. With `nopts` too, each slot's count must equal its nopts."""
    if not isinstance(value, (list, tuple)):
        raise RowError("bad_type", f"options must be a list (one list of token ids per slot), got {type_name(value)}")
    if len(value) != n_slots:
        raise RowError("length_mismatch", f"{n_slots} slots but {len(value)} options: one list of option ids per slot")
    out = []
    for i, opts in enumerate(value):
        if not isinstance(opts, (list, tuple)):
            raise RowError("bad_type", f"options[{i}] must be a list of token ids, got {type_name(opts)}")
        if not MIN_OPTIONS <= len(opts) <= MAX_OPTIONS:
            raise RowError("bad_nopts", f"options[{i}] has {len(opts)} ids, outside {MIN_OPTIONS}..{MAX_OPTIONS}")
        ids = _int_list(opts, f"options[{i}]")
        for j, x in enumerate(ids):
            if not 0 <= x < vocab_size:
                raise RowError("option_out_of_range", f"options[{i}][{j}] is outside [0, {vocab_size})")
        if len(set(ids)) != len(ids):
            raise RowError("duplicate_options", f"options[{i}] names a token id more than once")
        if nopts is not None and nopts[i] != len(ids):
            raise RowError("options_mismatch", f"nopts[{i}] and the length of options[{i}] differ: give one "
                           "of the two, or counts that agree")
        out.append(tuple(ids))
    return out


def check_row(row: Any, vocab_size: int, max_tokens: int, tokenizer: Any = None, images: Any = None,
              as_array: bool = False, answers: Any = None, bound: Any = False) -> dict:
    """Either form in, a validated token row out (text rows are tokenised with `tokenizer`). A row with `images`
    needs `images` (the model's statecache.rows.images.ImageSupport) and comes out with `images`: its located ImageRefs.
    as_array: a row without images comes out with `ids` as a read-only int64 array (`check_token_row`); a row with
    images keeps a list (statecache.rows.images and statecache.run.images work on lists). answers: the tokenizer's
    statecache.rows.text.AnswerTokens (the engine finds them once at start-up; None: found per call). The row comes out
    with `options`: per slot an option count (a token row's `nopts`: the model's first letters) or a tuple of token
    ids (a token row's `options`; a text row's letters as its slots read them). bound: the tokenizer's
    statecache.rows.text.TextBound (None: it has none; False: found per call)."""
    if isinstance(row, dict) and "ids" in row and any(k in row for k in TEXT_FIELDS):
        raise RowError("bad_row", "a row is either a token row (ids, ...) or a text row (state, questions), not both")
    has_images = isinstance(row, dict) and row.get("images") not in (None, [], ())
    if has_images and images is None:
        raise RowError("no_vision", "this row has images but the model has no vision tower (or no image processor)")
    if is_text_row(row):
        if tokenizer is None:
            raise RowError("bad_row", "text rows need a tokenizer; this caller has none")
        from statecache.rows.text import encode_text_row

        row = encode_text_row(row, tokenizer, max_tokens, images, answers, bound)
        refs = row.pop("images", None)
    else:
        refs = images.prepare(row["images"]) if has_images else None
        if isinstance(row, dict) and "images" in row:
            row = {k: v for k, v in row.items() if k != "images"}
    out = check_token_row(row, vocab_size, max_tokens, as_array=as_array and not refs)
    if refs:
        from statecache.rows.images import locate

        out["images"] = locate(out["ids"], refs, images.image_token_id)
    return out
