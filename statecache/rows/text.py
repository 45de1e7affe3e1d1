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

Images (statecache.rows.images): each `<|image|>` placeholder in the state or a question becomes the checkpoint's image
marker with its pad token expanded to the image's token count, inside the same pieces, so the state segment still
ends where the state does and equal screenshots give equal tokens.

Text is tokenised as text (`encode_parts`): control tokens (the tokenizer's added tokens) appear only where the
template or an image marker puts them; the same strings in a page, a question or an option split as ordinary text,
so a page cannot write a chat turn. Each slot reads its letters' tokens in its context (`answer_tokens`, found once
per tokenizer: " A" after the cue, "A" at the assistant's reply), given to the row as its `options`.

A text row too long for the limit is refused before anything is tokenised: `text_bound` reads from the tokenizer's
vocabulary how many characters of each class one token can cover, and a row with more than the limit's worth of one
class cannot fit (the reasoning is at `TextBound`).

Knows the tokenizer interface (`chat_template`, `apply_chat_template`, `encode`, `get_added_vocab`, a fast
tokenizer's `backend_tokenizer`) and the row contract; does not know the model or the queue. Deterministic: same row, same tokenizer, same ids.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import Any

from statecache.rows.contract import MAX_OPTIONS, MIN_OPTIONS, TEXT_FIELDS, RowError, check_fields, field_names
from statecache.rows.images import PLACEHOLDER

LETTERS = string.ascii_uppercase
ANSWER_CUE = "Answer:"
STATE_SEP = "\n\n"  # ends the state segment (only when the state is not empty)
QUESTION_SEP = "\n\n"  # starts every question piece after the first
MAX_QUESTIONS = 64
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
            raise RowError("bad_row", f"questions[{i}] must have exactly the fields text, options; got {field_names(q)}")
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


def _frame(state: str, tokenizer: Any) -> tuple[str, str, str]:
    """(template head, state segment's text, template tail) for this state: the head and tail are the template's
    markup (its control tokens count), the middle is the state plus STATE_SEP (text)."""
    state_part = state + STATE_SEP if state else ""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": state_part + _PLACEHOLDER}]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        head, found, tail = rendered.rpartition(_PLACEHOLDER)
        if found and head.endswith(state_part):
            return head[: len(head) - len(state_part)], state_part, tail
    return "", state_part, ""


def _plain_ids(tokenizer: Any, text: str, added_ids: set) -> list[int]:
    """text tokenised with no added token matched: what the tokenizer does between added tokens. Its own encode when
    that matched none (every row without such strings: one call, as fast as ever), else a fast tokenizer's
    normaliser, pre-tokeniser and model over the whole text (a slow one's encode with special tokens split)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if added_ids.isdisjoint(ids):
        return ids
    bt = getattr(tokenizer, "backend_tokenizer", None)
    if bt is None:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if bt.normalizer is not None:
        text = bt.normalizer.normalize_str(text)
    pieces = bt.pre_tokenizer.pre_tokenize_str(text) if bt.pre_tokenizer is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in bt.model.tokenize(piece)]


def _added(tokenizer: Any) -> tuple[dict, Any]:
    """The tokenizer's added tokens (control tokens and the like) {text: id} and a regex matching them, longest first."""
    added = dict(tokenizer.get_added_vocab()) if hasattr(tokenizer, "get_added_vocab") else {}
    return added, (re.compile("|".join(map(re.escape, sorted(added, key=len, reverse=True)))) if added else None)


def encode_parts(tokenizer: Any, parts: list[tuple[str, bool]]) -> list[int]:
    """parts: [(string, markup)] -> the ids of their concatenation as the tokenizer encodes it, except that an added
    token's string (`<|im_start|>`, ...) becomes that token only inside markup (the chat template's own text, the
    image markers); inside text (a page, a question, an option) it splits as ordinary text. So page text cannot write
    a chat role, and a text without such strings tokenises exactly as before."""
    added, pattern = _added(tokenizer)
    items: list = []  # strings to tokenise as text, and added-token ids
    run: list[str] = []
    for text, markup in parts:
        if markup and pattern is not None:
            at = 0
            for m in pattern.finditer(text):
                run.append(text[at : m.start()])
                items += ["".join(run), added[m.group()]]
                run, at = [], m.end()
            run.append(text[at:])
        else:
            run.append(text)
    items.append("".join(run))
    ids: list[int] = []
    added_ids = set(added.values())
    for it in items:
        if isinstance(it, int):
            ids.append(it)
        elif it:
            ids += _plain_ids(tokenizer, it, added_ids)
    return ids


def _text(text: str, images: Any, refs: list, k: int) -> tuple[list[tuple[str, bool]], int]:
    """One text as parts, each image placeholder (from image k on) turned into its marker (markup); -> (parts, next k)."""
    if not refs or PLACEHOLDER not in text:
        return [(text, False)], k
    pieces = text.split(PLACEHOLDER)
    parts = [(pieces[0], False)]
    for p in pieces[1:]:
        marker, k = images.expand(PLACEHOLDER, refs, k)
        parts += [(marker, True), (p, False)]
    return parts, k


@dataclass(frozen=True)
class AnswerTokens:
    """The option letters' tokens where a text row's slots read them: `cue`, after ANSWER_CUE (what the tokenizer
    writes for "Answer: A": a byte-level BPE's " A"); `reply`, at the start of the assistant's reply (the template
    tail followed by the letter), or None without a chat template (every slot then sits on a cue)."""

    cue: tuple[int, ...]
    reply: tuple[int, ...] | None

    def for_slot(self, last: bool, k: int) -> tuple[int, ...]:
        return ((self.reply if last and self.reply is not None else self.cue))[:k]


def _letter_tokens(tokenizer: Any, context: list[tuple[str, bool]], sep: str, where: str) -> tuple[int, ...]:
    """Per letter, the one token it adds after `context` (+ sep); ValueError naming the letter and context when a
    letter is not one token after the context's own tokens, or two letters share a token."""
    base = encode_parts(tokenizer, context)
    out = []
    for letter in LETTERS:
        ids = encode_parts(tokenizer, context + [(sep + letter, False)])
        if len(ids) != len(base) + 1 or ids[: len(base)] != base:
            raise ValueError(f"the tokenizer writes the option letter {letter!r} {where} as {len(ids) - len(base)} "
                             f"token(s) (ids {ids[len(base):]} after {len(base)}): an answer slot needs one token per letter there")
        out.append(ids[-1])
    if len(set(out)) != len(out):
        dup = [LETTERS[j] for j, x in enumerate(out) if out.count(x) > 1]
        raise ValueError(f"the option letters {', '.join(dup)} {where} share a token: the letters need distinct tokens")
    return tuple(out)


def answer_tokens(tokenizer: Any) -> AnswerTokens:
    """The option tokens of this tokenizer's text rows (found once at start-up; see AnswerTokens); ValueError, naming
    the letter and the context, for a tokenizer that does not write each letter as one distinct token there."""
    cue = _letter_tokens(tokenizer, [(ANSWER_CUE, False)], " ", f"after {ANSWER_CUE!r} (as {ANSWER_CUE + ' A'!r})")
    _, _, tail = _frame("", tokenizer)
    reply = _letter_tokens(tokenizer, [(tail, True)], "", f"at the assistant's reply (after {tail!r})") if tail else None
    return AnswerTokens(cue, reply)

# ---- the text bound: a row refused as too long before any tokenisation -------------------------------------------
#
# A byte-level BPE (the Qwen3.5 tokenizers, the tiny model's) turns the normalised text into UTF-8 bytes, splits it
# into pieces that keep every byte (ByteLevel, Split other than "Removed", Digits, Punctuation) and writes each piece
# as vocabulary tokens whose bytes add up to the piece's. Give each character to the token holding its first byte:
# a token of the vocabulary holds at most K[c] first bytes of class c (ASCII letters and digits, ASCII whitespace,
# other ASCII, non-ASCII characters), so a text with n[c] characters of class c is at least n[c] / K[c] tokens, for
# every c, however it is split, whatever else the row adds (template, option letters, the pieces the row is cut
# into only add tokens). So a row with n[c] > max_tokens * K[c] for some class cannot fit: it is refused
# (`too_long`) from counts over its bytes (C loops, milliseconds for megabytes) before the tokenizer runs, and no row
# that could fit is ever refused. K is read from the tokenizer's own vocabulary (`text_bound`), not assumed: per
# class it is the longest run a token of that class can cover (a run of spaces, "=====", a long word), so a page
# of ordinary text (mostly letters) is bounded by the vocabulary's longest letters-and-digits token, far tighter than
# one bound for all characters (which a token of 64 spaces would set). The characters are counted after the
# tokenizer's normaliser (NFC can join characters), each text on its own: in the row every text follows a newline,
# a space or the template's markup (ChatML's ends with a newline), none of which a character composes with, so the
# normaliser treats it there as alone (a template whose markup ends in a letter could join one character more per
# text). ASCII text skips the normaliser where it is a Unicode normal form (which leaves ASCII as it is). A tokenizer of another kind (no byte-level pre-tokeniser, a pre-tokeniser that
# drops characters, a slow tokenizer) has no bound (None): its rows are tokenised and counted.

_CLASSES = ("letters and digits", "whitespace", "other ASCII", "non-ASCII")
_ALNUM = bytes(b for b in range(128) if chr(b).isalnum())
_SPACE = bytes(b for b in range(128) if chr(b).isspace())
_OTHER = bytes(b for b in range(128) if b not in _ALNUM and b not in _SPACE)
_NON_ASCII = bytes(range(128, 256))
_KEEPS_EVERY_CHAR = {"ByteLevel", "Split", "Digits", "Punctuation", "Sequence"}
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}


def _counts(data: bytes) -> tuple[int, int, int, int]:
    """Characters of each class in UTF-8 `data`: ASCII bytes by class, and non-ASCII first bytes (0xC0-0xFF)."""
    n = len(data)
    alnum = n - len(data.translate(None, _ALNUM))
    space = n - len(data.translate(None, _SPACE))
    other = n - len(data.translate(None, _OTHER))
    lead = n - len(data.translate(None, _NON_ASCII[64:]))  # 0xC0..0xFF start a character; 0x80..0xBF continue one
    return alnum, space, other, lead


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's characters -> their bytes (GPT-2's bytes_to_unicode, inverted)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _pre_tokenizer_types(cfg) -> list[dict]:
    if not cfg:
        return []
    return [x for p in cfg.get("pretokenizers", []) for x in _pre_tokenizer_types(p)] if cfg["type"] == "Sequence" else [cfg]


def _normaliser_types(cfg) -> list[str]:
    if not cfg:
        return []
    return [x for n in cfg.get("normalizers", []) for x in _normaliser_types(n)] if cfg["type"] == "Sequence" else [cfg["type"]]


@dataclass(frozen=True)
class TextBound:
    """The most characters of each class one token of this tokenizer covers (see above); `refusal` says whether a
    row's texts are too long for `max_tokens` tokens without tokenising them."""

    per_token: tuple[int, int, int, int]  # K per class (_CLASSES)
    normalizer: Any = None  # the backend's normaliser (None: none)
    ascii_as_is: bool = True  # the normaliser leaves ASCII text as it is

    def counts(self, texts) -> list[int]:
        total = [0, 0, 0, 0]
        for t in texts:
            if self.normalizer is not None and not (self.ascii_as_is and t.isascii()):
                t = self.normalizer.normalize_str(t)
            for c, n in enumerate(_counts(t.encode("utf-8", "surrogatepass"))):
                total[c] += n
        return total

    def refusal(self, texts, max_tokens: int) -> str | None:
        """None, or the message of a row whose texts cannot fit in `max_tokens` tokens (one class alone needs more)."""
        for name, n, k in zip(_CLASSES, self.counts(texts), self.per_token):
            if n > max_tokens * k:
                return (f"{n} characters ({name}) of text, at least {-(-n // k)} tokens with this tokenizer (a token "
                        f"covers at most {k} of them), more than the limit {max_tokens}")
        return None


def text_bound(tokenizer: Any) -> TextBound | None:
    """This tokenizer's TextBound, read from its vocabulary (found once at start-up, like `answer_tokens`); None for a
    tokenizer the reasoning above does not cover."""
    bt = getattr(tokenizer, "backend_tokenizer", None)
    if bt is None:
        return None
    cfg = json.loads(bt.to_str())
    pre = _pre_tokenizer_types(cfg.get("pre_tokenizer"))
    if (cfg.get("model") or {}).get("type") != "BPE" or not any(p["type"] == "ByteLevel" for p in pre):
        return None
    if any(p["type"] not in _KEEPS_EVERY_CHAR or p.get("behavior") == "Removed" for p in pre):
        return None
    to_byte = _byte_decoder()
    k = [1, 1, 1, 1]
    for token in bt.get_vocab(with_added_tokens=True):
        data = bytes(to_byte[ch] for ch in token) if all(ch in to_byte for ch in token) else token.encode()
        k = [max(a, b) for a, b in zip(k, _counts(data))]
    norms = _normaliser_types(cfg.get("normalizer"))
    return TextBound(tuple(k), bt.normalizer, all(n in _UNICODE_FORMS for n in norms))


def encode_text_row(row: dict, tokenizer: Any, max_tokens: int, images: Any = None,
                    answers: AnswerTokens | None = None, bound: TextBound | None | bool = False) -> dict:
    """A text row as a token row `{ids, state_len, slots, options}` (plus `images`: unlocated ImageRefs, when the row
    has any); raises RowError if malformed or too long. images: the model's statecache.rows.images.ImageSupport. answers:
    the tokenizer's AnswerTokens (found at start-up; None: found now). Each slot's options are its letters' tokens
    in its context: after the cue, or at the assistant's reply for the last question under a chat template.
    bound: the tokenizer's TextBound (found at start-up; None: it has none; False: found now): a row it refuses is
    `too_long` before anything is tokenised."""
    state, questions = _check_text_row(row)
    if bound is False:
        bound = text_bound(tokenizer)
    if bound is not None:
        why = bound.refusal([state, *(t for q in questions for t in (q["text"], *q["options"]))], max_tokens)
        if why is not None:
            raise RowError("too_long", why)
    refs, k = [], 0
    if images is not None:
        n_ph = images.check_text(state, "state") + sum(
            images.check_text(q["text"], f"questions[{i}].text") for i, q in enumerate(questions))
        given = row.get("images") or []
        if not isinstance(given, (list, tuple)) or n_ph != len(given):
            n_img = len(given) if isinstance(given, (list, tuple)) else type(given).__name__
            raise RowError("image_count_mismatch", f"{n_ph} image placeholder(s) {PLACEHOLDER!r} in the texts, {n_img} image(s)")
        refs = images.prepare(given)
    head, state_part, tail = _frame(state, tokenizer)
    if answers is None:
        answers = answer_tokens(tokenizer)
    parts, k = _text(state_part, images, refs, 0)
    ids = encode_parts(tokenizer, [(head, True)] + parts)
    state_len = len(ids)
    slots, options = [], []
    for i, q in enumerate(questions):
        last = i == len(questions) - 1
        parts, k = _text((QUESTION_SEP if i else "") + question_text(q), images, refs, k)
        ids += encode_parts(tokenizer, parts + ([(tail, True)] if last else []))
        slots.append(len(ids) - 1)
        options.append(answers.for_slot(last and bool(tail), len(q["options"])))
    if len(ids) > max_tokens:
        raise RowError("too_long", f"text row tokenises to {len(ids)} tokens, more than the limit {max_tokens}")
    out = {"ids": ids, "state_len": state_len, "slots": slots, "options": options}
    if refs:
        out["images"] = refs
    return out
