"""Row contract checks: good rows pass normalised, every malformed row gets its own error code."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecache.protocol import error_result
from statecache.rows.check import RowError, check_row, check_token_row, is_text_row

VOCAB, MAX = 100, 64


def good(**over):
    row = {"ids": [1, 2, 3, 4, 5], "state_len": 3, "slots": [4], "nopts": [4]}
    row.update(over)
    return row


def code(row, **kw):
    with pytest.raises(RowError) as e:
        check_token_row(row, kw.get("vocab", VOCAB), kw.get("max_tokens", MAX))
    assert e.value.message and str(e.value).startswith(e.value.code)
    return e.value.code


def test_good_row_is_copied_and_normalised():
    row = good(ids=(1, 2, 3, 4, 5))
    out = check_token_row(row, VOCAB, MAX)
    assert out == {"ids": [1, 2, 3, 4, 5], "state_len": 3, "slots": [4], "options": [4]}
    assert out["slots"] is not row["slots"]


def test_numpy_ints_are_accepted():
    np = pytest.importorskip("numpy")
    out = check_token_row(good(ids=list(np.arange(1, 6)), state_len=np.int64(2)), VOCAB, MAX)
    assert out["ids"] == [1, 2, 3, 4, 5] and type(out["ids"][0]) is int and out["state_len"] == 2


@pytest.mark.parametrize(
    "row, expected",
    [
        ([1, 2, 3], "bad_row"),
        ("ids", "bad_row"),
        (None, "bad_row"),
        ({"ids": [1], "slots": [0], "nopts": [2]}, "bad_row"),  # missing state_len
        (good(extra=1), "bad_row"),
        (good(ids="12345"), "bad_type"),
        (good(ids=b"\x01\x02"), "bad_type"),
        (good(ids=[1, 2, True, 4, 5]), "bad_type"),
        (good(ids=[1, 2, 3.0, 4, 5]), "bad_type"),
        (good(ids=[1, [2], 3, 4, 5]), "bad_type"),
        (good(ids=[1, None, 3, 4, 5]), "bad_type"),
        (good(state_len=True), "bad_type"),
        (good(state_len=2.0), "bad_type"),
        (good(state_len="3"), "bad_type"),
        (good(slots=4), "bad_type"),
        (good(slots=[4.0]), "bad_type"),
        (good(nopts=[False]), "bad_type"),
        (good(nopts={"a": 1}), "bad_type"),
        (good(ids=[]), "empty"),
        (good(slots=[], nopts=[]), "empty"),
        (good(ids=[1] * (MAX + 1)), "too_long"),
        (good(ids=[1, 2, 3, 4, VOCAB]), "id_out_of_range"),
        (good(ids=[-1, 2, 3, 4, 5]), "id_out_of_range"),
        (good(ids=[1, 2, 3, 4, 2**63]), "id_out_of_range"),
        (good(state_len=6), "state_len_out_of_range"),
        (good(state_len=-1), "state_len_out_of_range"),
        (good(slots=[5]), "slot_out_of_range"),
        (good(slots=[-1]), "slot_out_of_range"),
        (good(slots=[4, 3], nopts=[4]), "length_mismatch"),
        (good(nopts=[1]), "bad_nopts"),
        (good(nopts=[27]), "bad_nopts"),
        (good(nopts=[0]), "bad_nopts"),
    ],
)
def test_malformed_rows(row, expected):
    assert code(row) == expected
    with pytest.raises(RowError) as e:  # the engine's form (ids as an int64 array) gives the same error
        check_token_row(row, VOCAB, MAX, as_array=True)
    assert e.value.code == expected


def test_as_array_gives_the_same_row_as_a_read_only_int64_array():
    np = pytest.importorskip("numpy")
    for ids in ([1, 2, 3, 4, 5], (0, 1, 0, 1, 99), list(np.arange(1, 6)), [0, 1, 2, 3, 4]):
        row = good(ids=ids)
        plain, arr = check_token_row(row, VOCAB, MAX), check_token_row(row, VOCAB, MAX, as_array=True)
        assert arr["ids"].dtype == np.int64 and not arr["ids"].flags.writeable
        assert arr["ids"].tolist() == plain["ids"] and {**arr, "ids": plain["ids"]} == plain
    with pytest.raises(RowError) as e:  # a bool among ids of 0 and 1 is found (bool is an int)
        check_token_row(good(ids=[0, 1, False, 1, 0]), VOCAB, MAX, as_array=True)
    assert e.value.code == "bad_type" and "ids[2]" in e.value.message
    assert check_row(good(), VOCAB, MAX, as_array=True)["ids"].tolist() == [1, 2, 3, 4, 5]


def test_message_names_the_place_and_the_rule_not_the_value():
    with pytest.raises(RowError) as e:
        check_token_row(good(ids=[1, 2, 3, 4, 500]), VOCAB, MAX)
    assert "ids[4]" in e.value.message and "[0, 100)" in e.value.message and "500" not in e.value.message
    secret = "PAGE-SECRET-TEXT"
    for row in (good(state_len=secret), good(ids=[1, 2, secret, 4, 5]), good(slots=[secret]), {**good(), secret: 1}):
        with pytest.raises(RowError) as e:
            check_token_row(row, VOCAB, MAX)
        assert secret not in e.value.message and "SECRET" not in str(e.value), e.value.message
    for row in (good(state_len=987654), good(slots=[987654]), good(nopts=[987654])):
        with pytest.raises(RowError) as e:
            check_token_row(row, VOCAB, MAX)
        assert "987654" not in e.value.message, e.value.message


def test_edges_are_accepted():
    check_token_row(good(state_len=0), VOCAB, MAX)
    check_token_row(good(state_len=5), VOCAB, MAX)
    check_token_row(good(ids=[0, VOCAB - 1], state_len=1, slots=[0, 1], nopts=[2, 26]), VOCAB, MAX)
    check_token_row(good(ids=[1] * MAX), VOCAB, MAX)


def test_is_text_row_and_error_result():
    assert is_text_row({"state": "s", "questions": []})
    assert is_text_row({"questions": []})
    assert not is_text_row(good())
    assert not is_text_row({"ids": [1], "state": "x"})
    assert not is_text_row("state")
    assert error_result("empty", "ids is empty") == {"error": {"code": "empty", "message": "ids is empty"}}


def test_check_row_dispatches(chatml_tokenizer):
    assert check_row(good(), VOCAB, MAX) == check_token_row(good(), VOCAB, MAX)
    text = {"state": "the page", "questions": [{"text": "ok?", "options": ["yes", "no"]}]}
    out = check_row(text, len(chatml_tokenizer), 1000, tokenizer=chatml_tokenizer)
    assert len(out["options"]) == 1 and len(out["options"][0]) == 2 and out["slots"] == [len(out["ids"]) - 1]
    with pytest.raises(RowError, match="need a tokenizer"):
        check_row(text, VOCAB, MAX)
    with pytest.raises(RowError, match="not both"):
        check_row({**good(), "state": "x"}, VOCAB, MAX)


rows = st.integers(1, 40).flatmap(
    lambda n: st.fixed_dictionaries(
        {
            "ids": st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n),
            "state_len": st.integers(0, n),
            "slots": st.lists(st.integers(0, n - 1), min_size=1, max_size=4),
        }
    )
)


@settings(max_examples=200, deadline=None)
@given(rows, st.data())
def test_valid_rows_survive_msgpack(row, data):
    row["nopts"] = data.draw(st.lists(st.integers(2, 26), min_size=len(row["slots"]), max_size=len(row["slots"])))
    wire = msgpack.unpackb(msgpack.packb(row), raw=False)
    want = {**{k: v for k, v in row.items() if k != "nopts"}, "options": row["nopts"]}
    assert check_token_row(wire, VOCAB, MAX) == want
    arr = check_token_row(wire, VOCAB, MAX, as_array=True)
    assert arr["ids"].tolist() == row["ids"] and {**arr, "ids": row["ids"]} == want


junk = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["ids", "state_len", "slots", "nopts", "options", "x"]), junk) | junk)
def test_junk_never_crashes(row):
    """Anything msgpack can deliver either passes or raises RowError, never anything else."""
    try:
        out = check_token_row(row, VOCAB, MAX)
    except RowError as e:
        assert e.code and e.message
        with pytest.raises(RowError) as e2:  # the engine's form refuses it the same way
            check_token_row(row, VOCAB, MAX, as_array=True)
        assert (e2.value.code, e2.value.message) == (e.code, e.message)
    else:
        assert set(out) == {"ids", "state_len", "slots", "options"}
        assert check_token_row(row, VOCAB, MAX, as_array=True)["ids"].tolist() == out["ids"]
