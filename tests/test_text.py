"""Text rows: chat template, the state as its own segment, slots where the answer letter comes."""

import pytest

from statecache.rows.check import RowError, check_token_row
from statecache.rows.text import ANSWER_CUE, encode_text_row, question_text

Q1 = {"text": "Is this a login page?", "options": ["yes", "no"]}
Q2 = {"text": "What next?", "options": ["click", "type", "scroll"]}
STATE = "goal: log in\nthe page shows a login form\nsteps taken: opened the site"


def enc(tok, state=STATE, questions=(Q1,), max_tokens=4096):
    return encode_text_row({"state": state, "questions": list(questions)}, tok, max_tokens)


def test_one_question_chat_template(chatml_tokenizer):
    tok = chatml_tokenizer
    row = enc(tok)
    check_token_row(row, len(tok), 4096)
    text = tok.decode(row["ids"])
    assert text.startswith("<|im_start|>user\n" + STATE)
    assert text.endswith(ANSWER_CUE + "<|im_end|>\n<|im_start|>assistant\n")
    assert row["slots"] == [len(row["ids"]) - 1]  # the letter would be the assistant's first token
    assert [len(o) for o in row["options"]] == [2]
    assert tok.decode(row["ids"][: row["state_len"]]) == "<|im_start|>user\n" + STATE + "\n\n"
    assert "A. yes\nB. no" in text


def test_same_state_same_leading_tokens(chatml_tokenizer):
    a, b = enc(chatml_tokenizer, questions=[Q1]), enc(chatml_tokenizer, questions=[Q2, Q1])
    assert a["state_len"] == b["state_len"]
    assert a["ids"][: a["state_len"]] == b["ids"][: b["state_len"]]
    assert a["ids"][a["state_len"] :] != b["ids"][b["state_len"] :]


def test_grown_state_shares_most_tokens(chatml_tokenizer):
    a = enc(chatml_tokenizer)
    b = enc(chatml_tokenizer, state=STATE + "; clicked sign in")
    shared = next(i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y)
    assert shared >= a["state_len"] - 4 and b["state_len"] > a["state_len"]


def test_several_questions_each_get_a_slot(chatml_tokenizer):
    tok = chatml_tokenizer
    row = enc(tok, questions=[Q1, Q2])
    assert [len(o) for o in row["options"]] == [2, 3] and len(row["slots"]) == 2
    first, last = row["slots"]
    assert tok.decode(row["ids"][: first + 1]).endswith(question_text(Q1))
    assert tok.decode(row["ids"][first + 1 :]).startswith("\n\n" + question_text(Q2))
    assert last == len(row["ids"]) - 1
    assert row["state_len"] <= first < last


def test_plain_template_without_chat_template(plain_tokenizer):
    tok = plain_tokenizer
    row = enc(tok, questions=[Q1, Q2])
    assert tok.decode(row["ids"]) == STATE + "\n\n" + question_text(Q1) + "\n\n" + question_text(Q2)
    assert tok.decode(row["ids"][: row["state_len"]]) == STATE + "\n\n"
    assert all(tok.decode(row["ids"][: s + 1]).endswith(ANSWER_CUE) for s in row["slots"])


def test_empty_state_is_allowed(chatml_tokenizer, plain_tokenizer):
    assert enc(plain_tokenizer, state="")["state_len"] == 0
    row = enc(chatml_tokenizer, state="")
    assert chatml_tokenizer.decode(row["ids"][: row["state_len"]]) == "<|im_start|>user\n"


def test_deterministic(chatml_tokenizer):
    assert enc(chatml_tokenizer, questions=[Q1, Q2]) == enc(chatml_tokenizer, questions=[Q1, Q2])


def test_letters_up_to_z(chatml_tokenizer):
    q = {"text": "pick", "options": [str(i) for i in range(26)]}
    row = enc(chatml_tokenizer, questions=[q])
    assert [len(o) for o in row["options"]] == [26] and "Z. 25" in chatml_tokenizer.decode(row["ids"])


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"state": 1, "questions": [Q1]}, "bad_type"),
        ({"state": "s", "questions": "q"}, "bad_type"),
        ({"state": "s", "questions": []}, "empty"),
        ({"state": "s"}, "bad_row"),
        ({"state": "s", "questions": [Q1], "x": 1}, "bad_row"),
        ({"state": "s", "questions": ["q"]}, "bad_type"),
        ({"state": "s", "questions": [{"text": "q"}]}, "bad_row"),
        ({"state": "s", "questions": [{"text": 3, "options": ["a", "b"]}]}, "bad_type"),
        ({"state": "s", "questions": [{"text": "q", "options": "ab"}]}, "bad_type"),
        ({"state": "s", "questions": [{"text": "q", "options": ["a"]}]}, "bad_nopts"),
        ({"state": "s", "questions": [{"text": "q", "options": ["a"] * 27}]}, "bad_nopts"),
        ({"state": "s", "questions": [{"text": "q", "options": ["a", 2]}]}, "bad_type"),
        ({"state": "s", "questions": [Q1] * 65}, "too_long"),
    ],
)
def test_malformed_text_rows(chatml_tokenizer, row, expected):
    with pytest.raises(RowError) as e:
        encode_text_row(row, chatml_tokenizer, 4096)
    assert e.value.code == expected


def test_too_long(chatml_tokenizer):
    with pytest.raises(RowError, match="more than the limit 20") as e:
        enc(chatml_tokenizer, max_tokens=20)
    assert e.value.code == "too_long"
    with pytest.raises(RowError, match="characters") as e:
        enc(chatml_tokenizer, state="x" * 100_000, max_tokens=20)


def test_the_tiny_models_tokenizer():
    from statecache.dev.tiny import build_tokenizer

    tok = build_tokenizer()
    letters = tok.convert_tokens_to_ids(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    assert len(set(letters)) == 26 and tok.unk_token_id not in letters
    a, b = enc(tok, questions=[Q1]), enc(tok, questions=[Q2])
    assert a["ids"][: a["state_len"]] == b["ids"][: b["state_len"]]
    assert tok.decode(a["ids"]).endswith("Answer:<|im_end|>\n<|im_start|>assistant\n")
    assert a["slots"] == [len(a["ids"]) - 1]
