"""Text rows to token rows: `{state, questions}` rendered with the model's chat template and tokenised.

Layout (one user turn, then the assistant turn's prefix):

    <template head> STATE "\\n\\n"  | Q1 "\\nA. ..\\nB. ..\\nAnswer:" | "\\n\\n" Q2 ... "Answer:" <template tail>
    `------ state segment -------'  `------------------ question segments -----------------------------'

The state segment (template head + state + separator) is tokenised on its own, so every row with the same
state starts with the same tokens and `state_len` is its length. Each question is tokenised on its own
piece, so each answer slot is the last token of a piece: a question followed by another answers right after
its "Answer:" cue; the last question answers where the assistant's reply (the letter) would start, i.e. at
the last token of the template tail. Without a chat template the plain layout is the same minus head and
tail (every slot then sits on an "Answer:" cue).

Images (statecache.images): each `<|image|>` placeholder in the state or a question becomes the checkpoint's image
marker with its pad token expanded to the image's token count, inside the same pieces, so the state segment still
ends where the state does and equal screenshots give equal tokens.

Knows the tokenizer interface (`chat_template`, `apply_chat_template`, `encode`) and the row contract; does
not know the model, the letters' token ids, or the queue. Deterministic: same row, same tokenizer, same ids.
"""

from __future__ import annotations

import string
from typing import Any

from statecache.images import PLACEHOLDER
from statecache.rows import MAX_OPTIONS, MIN_OPTIONS, TEXT_FIELDS, RowError, check_fields

LETTERS = string.ascii_uppercase
ANSWER_CUE = "Answer:"
STATE_SEP = "\n\n"  # ends the state segment (only when the state is not empty)
QUESTION_SEP = "\n\n"  # starts every question piece after the first
MAX_QUESTIONS = 64
CHARS_PER_TOKEN_BOUND = 64  # text longer than max_tokens * this is too long without tokenising it
_PLACEHOLDER = "\x00statecache:questions\x00"


def _check_text_row(row: Any) -> tuple[str, list[dict]]:
    check_fields(row, TEXT_FIELDS, "text")
    state, questions = row["state"], row["questions"]
    if not isinstance(state, str):
        raise RowError("bad_type", f"state must be a string, got {type(state).__name__}")
    if not isinstance(questions, (list, tuple)):
        raise RowError("bad_type", f"questions must be a list, got {type(questions).__name__}")
    if not questions:
        raise RowError("empty", "questions is empty: a row needs at least one question")
    if len(questions) > MAX_QUESTIONS:
        raise RowError("too_long", f"{len(questions)} questions, more than the limit {MAX_QUESTIONS}")
    for i, q in enumerate(questions):
        if not isinstance(q, dict):
            raise RowError("bad_type", f"questions[{i}] must be a map {{text, options}}, got {type(q).__name__}")
        if set(q) != {"text", "options"}:
            raise RowError("bad_row", f"questions[{i}] must have exactly the fields text, options; got {sorted(map(str, q))}")
        if not isinstance(q["text"], str):
            raise RowError("bad_type", f"questions[{i}].text must be a string, got {type(q['text']).__name__}")
        opts = q["options"]
        if not isinstance(opts, (list, tuple)):
            raise RowError("bad_type", f"questions[{i}].options must be a list of strings, got {type(opts).__name__}")
        if not MIN_OPTIONS <= len(opts) <= MAX_OPTIONS:
            raise RowError("bad_nopts", f"questions[{i}] has {len(opts)} options, outside {MIN_OPTIONS}..{MAX_OPTIONS}")
        for j, o in enumerate(opts):
            if not isinstance(o, str):
                raise RowError("bad_type", f"questions[{i}].options[{j}] must be a string, got {type(o).__name__}")
    return state, list(questions)


def question_text(question: dict) -> str:
    """One question as the model reads it: text, lettered options, the answer cue."""
    lines = [question["text"]]
    lines += [f"{LETTERS[j]}. {opt}" for j, opt in enumerate(question["options"])]
    lines.append(ANSWER_CUE)
    return "\n".join(lines)


def _frame(state: str, tokenizer: Any) -> tuple[str, str]:
    """(state segment text, template tail text) for this state."""
    state_part = state + STATE_SEP if state else ""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": state_part + _PLACEHOLDER}]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        head, found, tail = rendered.rpartition(_PLACEHOLDER)
        if found and head.endswith(state_part):
            return head, tail
    return state_part, ""


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def encode_text_row(row: dict, tokenizer: Any, max_tokens: int, images: Any = None) -> dict:
    """A text row as a token row `{ids, state_len, slots, nopts}` (plus `images`: unlocated ImageRefs, when the row
    has any); raises RowError if malformed or too long. images: the model's statecache.images.ImageSupport."""
    state, questions = _check_text_row(row)
    chars = len(state) + sum(len(q["text"]) + sum(map(len, q["options"])) for q in questions)
    if chars > max_tokens * CHARS_PER_TOKEN_BOUND:
        raise RowError("too_long", f"{chars} characters of text, far over the limit of {max_tokens} tokens")
    refs, k = [], 0
    if images is not None:
        n_ph = images.check_text(state, "state") + sum(
            images.check_text(q["text"], f"questions[{i}].text") for i, q in enumerate(questions))
        given = row.get("images") or []
        if not isinstance(given, (list, tuple)) or n_ph != len(given):
            n_img = len(given) if isinstance(given, (list, tuple)) else type(given).__name__
            raise RowError("image_count_mismatch", f"{n_ph} image placeholder(s) {PLACEHOLDER!r} in the texts, {n_img} image(s)")
        refs = images.prepare(given)
    head, tail = _frame(state, tokenizer)
    if refs:
        head, k = images.expand(head, refs, k)
    ids = _encode(tokenizer, head)
    state_len = len(ids)
    slots = []
    for i, q in enumerate(questions):
        piece = (QUESTION_SEP if i else "") + question_text(q) + (tail if i == len(questions) - 1 else "")
        if refs:
            piece, k = images.expand(piece, refs, k)
        ids += _encode(tokenizer, piece)
        slots.append(len(ids) - 1)
    if len(ids) > max_tokens:
        raise RowError("too_long", f"text row tokenises to {len(ids)} tokens, more than the limit {max_tokens}")
    out = {"ids": ids, "state_len": state_len, "slots": slots, "nopts": [len(q["options"]) for q in questions]}
    if refs:
        out["images"] = refs
    return out
