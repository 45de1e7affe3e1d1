"""Rows with images, on the tiny model with a vision tower (statecache.dev.tiny.tiny_vl_model_dir: every parameter of
text model and tower perturbed), against transformers' own Qwen3_5ForConditionalGeneration in float32 on the CPU,
every row through the engine's step loop (a piece holding image tokens in an eager forward of its own, exact or with
its shapes bucketed and padding masked as on the GPU): one and two images, in the state and in the question, plain
(uncached, beside a text row) and cached (cold, hit with a new question, a state grown after the image, a different
image at the same place); the step loop's batch graphs (stand-ins replaying the Triton batch kernels in the
interpreter) for the text pieces after an image, with and without specialists, against transformers and
`Engine.uncached`; the multimodal positions against transformers' get_rope_index; the token form; bad image inputs
each a clear error result.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image

from statecache.cache.config import CacheSettings
from statecache.dev.checkpoints import load_reference
from statecache.dev.tiny import tiny_model_dir, tiny_vl_model_dir
from statecache.engine import Engine
from statecache.rows import images as images_mod
from statecache.rows.check import check_row
from statecache.rows.images import PLACEHOLDER, positions
from tests.cache_util import answer_in_waves, assert_close, make_steps, one_thread
from tests.oracle_util import option_ids

TOL = 1e-4
WORDS = "the agent opened the page and read the form; the next step is to choose a field. "


@pytest.fixture(scope="module", autouse=True)
def _threads():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def model_dir():
    return tiny_vl_model_dir()


@pytest.fixture(scope="module")
def ref(model_dir):
    return load_reference(model_dir)


@pytest.fixture(params=[pytest.param(False, id="exact"), pytest.param(True, id="padded")])
def make(request, model_dir):
    """An engine on the CPU; padded: its batched runner buckets each forward's shapes and masks the padding (as on
    the GPU, where the graphs pad and a piece holding image tokens runs eagerly at its bucket's shape)."""

    def make(**kw) -> Engine:
        kw.setdefault("settings", CacheSettings(min_prefix=64, stride=192, host_mb=0))
        eng = Engine(model_dir, device="cpu", dtype="float32", **kw)
        eng.runner.pad = request.param
        return eng

    return make


def png(seed: int, w: int = 40, h: int = 24, fmt: str = "PNG") -> bytes:
    """A generated screenshot-like image: random blocks of colour."""
    rng = np.random.default_rng(seed)
    a = np.repeat(np.repeat(rng.integers(0, 256, (h // 4 + 1, w // 4 + 1, 3), dtype=np.uint8), 4, 0), 4, 1)[:h, :w]
    b = io.BytesIO()
    Image.fromarray(a).save(b, fmt)
    return b.getvalue()


def q(text: str, n: int = 3) -> dict:
    return {"text": text, "options": [f"option {j}" for j in range(n)]}


def hf_inputs(eng: Engine, raw: dict) -> tuple[dict, torch.Tensor, dict]:
    """A row checked by the engine -> (the row, its ids [1, n], transformers' image inputs: pixel values, grids and
    token types; empty without images)."""
    row = check_row(raw, eng.vocab_size, eng.max_row_tokens, eng.tokenizer, eng.images)
    ids = torch.tensor([row["ids"]])
    kw = {}
    if row.get("images"):
        pv = [eng.images.pixels(r.data) for r in row["images"]]
        kw = dict(pixel_values=torch.cat([p for p, _ in pv]), image_grid_thw=torch.tensor([g for _, g in pv]),
                  mm_token_type_ids=(ids == eng.images.image_token_id).int())
    return row, ids, kw


def reference(eng: Engine, ref, raw: dict) -> list[list[float]]:
    """transformers' answer for a row: its full forward with pixel values, grids and token types."""
    row, ids, kw = hf_inputs(eng, raw)
    with torch.no_grad():
        logits = ref(input_ids=ids, **kw).logits[0]
    out = []
    for s, k in zip(row["slots"], row["options"]):
        out.append(torch.softmax(logits[s, option_ids(eng.letter_ids, k)].double(), -1).tolist())
    return out


def check(eng, ref, raws, results):
    for raw, res in zip(raws, results):
        assert "probs" in res, res
        assert_close(res["probs"], reference(eng, ref, raw), TOL)


# ---- uncached ----------------------------------------------------------------------------------------------------


def test_plain_rows_with_one_and_two_images_beside_a_text_row(make, ref):
    """No cache: each row through the step loop from nothing (path "plain"), the two image rows in one eager forward,
    the text row beside them."""
    eng = make(settings=CacheSettings(mb=0, host_mb=0))  # everything plain
    rows = [
        {"state": f"{WORDS}screen: {PLACEHOLDER} end", "questions": [q("Is it a login page?", 2)], "images": [png(1)]},
        {"state": WORDS * 2, "questions": [q("A text row beside them?")]},
        {"state": f"before {PLACEHOLDER} {WORDS}", "questions": [q(f"Compare with {PLACEHOLDER}: same?", 2), q("Next?")],
         "images": [png(2), png(3, 16, 28)]},
    ]
    res = eng.answer(rows)
    assert [r["path"] for r in res] == ["plain"] * 3
    check(eng, ref, rows, res)
    assert eng.embeddings.stats["vision_runs"] == 3


def test_positions_equal_transformers_get_rope_index(model_dir, ref):
    eng = Engine(model_dir, device="cpu", dtype="float32")
    raw = {"state": f"a {PLACEHOLDER} b {PLACEHOLDER}", "questions": [q(f"c {PLACEHOLDER}?")],
           "images": [png(4), png(5, 16, 28), png(6, 28, 12)]}
    row = check_row(raw, eng.vocab_size, eng.max_row_tokens, eng.tokenizer, eng.images)
    ids = torch.tensor([row["ids"]])
    grids = torch.tensor([r.grid for r in row["images"]])
    want, _ = ref.model.get_rope_index(ids, mm_token_type_ids=(ids == eng.images.image_token_id).int(), image_grid_thw=grids)
    got = positions(len(row["ids"]), row["images"], eng.images.merge)
    assert np.array_equal(got, want[:, 0].numpy())
    from statecache.run.images import RowImages

    mm = RowImages(row["ids"], row["images"], eng.embeddings, "cpu")
    for s in range(len(row["ids"])):  # the text shift a chunk from s runs with, without the positions
        if not mm.has_image(s, s + 1):
            assert mm.shift(s) == got[0, s] - s
    assert got[0, -1] - (len(row["ids"]) - 1) < 0  # text after images runs at positions below its index


def test_text_rows_unchanged_on_the_vision_checkpoint(make, ref):
    eng = make()
    rows = [{"state": WORDS * 4, "questions": [q("Text only?")]}, {"state": WORDS * 4, "questions": [q("Again?", 2)]}]
    res = eng.answer(rows)
    check(eng, ref, rows, res)
    assert res[1]["path"] == "hit" and eng.embeddings.stats["vision_runs"] == 0


def test_token_form_with_images_equals_text_form(make, ref):
    eng = make(settings=CacheSettings(mb=0, host_mb=0))
    raw = {"state": f"{WORDS}{PLACEHOLDER}", "questions": [q("What is shown?")], "images": [png(7)]}
    row = check_row(raw, eng.vocab_size, eng.max_row_tokens, eng.tokenizer, eng.images)
    tok = {"ids": row["ids"], "state_len": row["state_len"], "slots": row["slots"], "options": row["options"],
           "images": [png(7)]}
    a, b = eng.answer([raw])[0], eng.answer([tok])[0]
    assert_close(a["probs"], b["probs"], 1e-6)
    assert b["path"] == "memo"  # equal tokens and equal image: the same row


# ---- cached -------------------------------------------------------------------------------------------------------


def test_cached_hit_grown_state_and_a_different_image(make, ref):
    eng = make()
    state = f"{WORDS * 3}{PLACEHOLDER}{WORDS * 3}"
    a = {"state": state, "questions": [q("Where is the button?")], "images": [png(10)]}
    res = eng.answer([a])[0]
    assert res["path"] == "cold"
    check(eng, ref, [a], [res])
    runs = eng.embeddings.stats["vision_runs"]
    assert runs == 1

    b = dict(a, questions=[q("Is the form complete?", 2), q("Next?", 4)])  # same screenshot, new questions: a hit
    res = eng.answer([b])[0]
    assert res["path"] == "hit" and res["reused"] > 0
    check(eng, ref, [b], [res])
    assert eng.embeddings.stats["vision_runs"] == runs  # the state past the image was restored: no tower at all

    c = dict(a, state=state + "clicked the sign-in button; " * 12)  # grown after the image
    res = eng.answer([c])[0]
    assert res["path"] == "partial"
    img_end = check_row(c, eng.vocab_size, 4096, eng.tokenizer, eng.images)["images"][0].end
    assert res["reused"] > img_end  # continued from a checkpoint past the image: the rotary offset restored
    check(eng, ref, [c], [res])

    d = dict(a, images=[png(11)])  # another screenshot of the same size, at the same place: never matched
    row_d = check_row(d, eng.vocab_size, 4096, eng.tokenizer, eng.images)
    row_a = check_row(a, eng.vocab_size, 4096, eng.tokenizer, eng.images)
    assert row_d["ids"] == row_a["ids"]  # the same tokens: only the image tells them apart
    res = eng.answer([d])[0]
    assert res["path"] in ("cold", "partial") and res["reused"] <= row_d["images"][0].start
    check(eng, ref, [d], [res])
    assert eng.embeddings.stats["vision_runs"] == runs + 1
    assert eng.phases["step_rows"] == 4  # every row answered by the step loop


def test_cached_images_in_state_and_question(make, ref):
    eng = make()
    state = f"{PLACEHOLDER}{WORDS * 4}{PLACEHOLDER}{WORDS}"
    imgs = [png(20, 16, 28), png(21)]
    a = {"state": state, "questions": [q(f"Which matches {PLACEHOLDER}?")], "images": imgs + [png(22, 12, 12)]}
    b = {"state": state, "questions": [q(f"And {PLACEHOLDER}?", 2)], "images": imgs + [png(23, 20, 20)]}
    res = eng.answer([a])
    assert res[0]["path"] == "cold"
    check(eng, ref, [a], res)
    res = eng.answer([b])
    assert res[0]["path"] == "hit"  # the question's own image runs in the question chunk
    check(eng, ref, [b], res)
    assert eng.embeddings.stats["vision_runs"] == 4  # each image once


def test_one_batch_groups_image_rows_by_image(make, ref):
    eng = make()
    state = f"{WORDS * 3}{PLACEHOLDER}{WORDS * 2}"
    rows = [{"state": state, "questions": [q(f"Question {k}?")], "images": [png(30 + k % 2)]} for k in range(4)]
    res = eng.answer(rows)
    check(eng, ref, rows, res)
    assert sorted(r["path"] for r in res) == ["cold", "cold", "hit", "hit"]
    assert eng.embeddings.stats["vision_runs"] == 2


_SHOTS = [png(60), png(61), png(62, 16, 28)]


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(data=st.data(), step_tokens=st.sampled_from([96, 320, 2048]), step_chunk=st.sampled_from([64, 192]),
       mb=st.sampled_from([1, 64]))
def test_random_waves_of_image_and_text_rows_through_the_step(make, ref, data, step_tokens, step_chunk, mb):
    """Waves of rows (a state with a screenshot asked again, grown after it, another screenshot at the same place, a
    new state with or without images, a text row), each wave submitted and a few steps run before the next comes, on
    random step budgets, chunk sizes and cache budgets: every row is answered once, through the step loop, as
    transformers answers it (float32, 1e-4), and the cache stays inside its budget."""
    eng = make(step_tokens=step_tokens, step_chunk=step_chunk,
               settings=CacheSettings(min_prefix=64, stride=192, mb=mb, host_mb=0))
    states: list[tuple[str, int]] = []  # (state text, screenshot index)
    waves, k = [], 0
    for wave, steps in data.draw(st.lists(st.tuples(st.lists(st.sampled_from(["again", "grow", "other", "new", "text"]),
                                                             min_size=1, max_size=3), st.integers(0, 2)),
                                          min_size=1, max_size=3)):
        batch = []
        for op in wave:
            k += 1
            if op == "text":
                batch.append({"state": WORDS * (2 + k % 3), "questions": [q(f"Text {k}?", 2 + k % 3)]})
                continue
            if op == "new" or not states:
                states.append((f"{WORDS * (1 + k % 3)}{PLACEHOLDER}{WORDS * 2}", k % len(_SHOTS)))
            state, shot = states[data.draw(st.integers(0, len(states) - 1))]
            if op == "grow":
                state += "clicked the next field; " * (4 + k % 5)
                states.append((state, shot))
            elif op == "other":
                shot = (shot + 1) % len(_SHOTS)
            batch.append({"state": state, "questions": [q(f"Question {k}?", 2 + k % 3)], "images": [_SHOTS[shot]]})
        waves.append((batch, steps))
    rows = [r for batch, _ in waves for r in batch]
    res = answer_in_waves(eng, waves)
    check(eng, ref, rows, res)
    for r in res:
        event(r["path"])
    assert eng.cache.index.bytes <= eng.cache.index.budget_bytes


# ---- bad image inputs ---------------------------------------------------------------------------------------------


def _code(res: dict) -> str:
    assert "error" in res, res
    return res["error"]["code"]


def test_bad_images_get_clear_errors_and_the_batch_goes_on(make, ref, monkeypatch):
    eng = make()
    good = {"state": f"{WORDS}{PLACEHOLDER}", "questions": [q("ok?")], "images": [png(40)]}
    bad = {
        "undecodable": dict(good, images=[b"\x89PNG\r\n\x1a\n not really"]),
        "truncated": dict(good, images=[png(41)[:60]]),
        "gif": dict(good, images=[png(42, fmt="GIF")]),
        "not_bytes": dict(good, images=["aGVsbG8="]),
        "fewer_images": dict(good, images=[]),
        "more_images": dict(good, images=[png(40), png(43)]),
        "spelled_out": dict(good, state=WORDS + "<|image_pad|>"),
        "images_not_list": dict(good, images=png(40)),
    }
    want = {"undecodable": "bad_image", "truncated": "bad_image", "gif": "bad_image", "not_bytes": "bad_image",
            "fewer_images": "image_count_mismatch", "more_images": "image_count_mismatch", "spelled_out": "bad_row",
            "images_not_list": "image_count_mismatch"}
    res = eng.answer(list(bad.values()) + [good])
    for (name, _), r in zip(bad.items(), res):
        assert _code(r) == want[name], (name, r)
        assert r["error"]["message"]
    check(eng, ref, [good], res[-1:])

    monkeypatch.setattr(images_mod, "MAX_IMAGE_BYTES", 100)
    assert _code(eng.answer([dict(good, images=[png(44)])])[0]) == "image_too_large"
    monkeypatch.setattr(images_mod, "MAX_IMAGE_BYTES", 32 * 2**20)
    monkeypatch.setattr(images_mod, "MAX_IMAGE_PIXELS", 100)
    assert _code(eng.answer([dict(good, images=[png(45)])])[0]) == "image_too_large"


def test_bad_token_form_image_runs(make):
    eng = make()
    raw = {"state": f"{WORDS}{PLACEHOLDER}", "questions": [q("x?")], "images": [png(50)]}
    row = check_row(raw, eng.vocab_size, 4096, eng.tokenizer, eng.images)
    tok = {k: row[k] for k in ("ids", "state_len", "slots", "options")}
    pad = eng.images.image_token_id
    short = dict(tok, ids=[t for i, t in enumerate(tok["ids"]) if not (t == pad and i == row["images"][0].start)],
                 images=[png(50)])
    short["slots"] = [s - 1 for s in tok["slots"]]
    res = eng.answer([short, dict(tok, images=[png(50), png(51)]), dict(tok, images=[])])
    assert [_code(r) for r in res[:2]] == ["image_tokens_mismatch", "image_tokens_mismatch"]
    assert "probs" in res[2]  # the pad tokens without images: a text row (their own embedding), as transformers does


def test_images_on_a_text_only_model_are_refused():
    eng = Engine(tiny_model_dir(), device="cpu", dtype="float32")
    res = eng.answer([{"state": f"a {PLACEHOLDER}", "questions": [q("x?")], "images": [png(60)]}])
    assert _code(res[0]) == "no_vision"


# ---- through Redis and the worker ---------------------------------------------------------------------------------


def test_demo_screenshot_rows_through_the_worker(redis_url, queue_name, model_dir, capsys):
    """The demo's screenshot rows (generated PNGs) through Redis and the arq worker on the real engine: answers,
    hits on repeated screenshots, no errors."""
    from producer import demo
    from tests.harness import InProcessWorker

    make = lambda: Engine(model_dir, device="cpu", dtype="float32",  # noqa: E731
                          settings=CacheSettings(min_prefix=64, host_mb=0))
    with InProcessWorker(redis_url, queue_name, make) as w:
        rc = demo.main(["--seconds", "2", "--every-s", "1", "--agents", "2", "--redis-url", redis_url,
                        "--queue", queue_name, "--screenshots"])
        stats = w.engine.stats()
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "== done:" in out and " 0 errors" in out
    assert stats["vision"]["vision_runs"] >= 1 and stats["errors"] == 0 and stats["rows"] > 2


def test_checkpoint_inside_an_image_continues_with_the_image_tail(make, ref):
    """Checkpoints every 64 tokens: one falls inside the image's pad run. A row that shares the state up to the end
    of the image and differs after it restores that checkpoint and runs the rest of the image (its embeddings from
    the middle on, at their grid positions) in its first chunk."""
    eng = make(settings=CacheSettings(min_prefix=64, stride=64, tail=0, host_mb=0))
    img = png(70, 32, 32)  # 8 x 8 merged tokens: 64 of them, so a multiple of 64 lies inside (or at its edge)
    for extra in range(0, 64, 7):
        a = {"state": "x" * extra + f"{WORDS * 2}{PLACEHOLDER}{WORDS * 3}", "questions": [q("First?")], "images": [img]}
        r = check_row(a, eng.vocab_size, 4096, eng.tokenizer, eng.images)["images"][0]
        inside = [c for c in range(64, r.end, 64) if r.start < c < r.end]
        if inside:
            break
    assert inside, "no layout put a checkpoint inside the image"
    res = eng.answer([a])[0]
    assert res["path"] == "cold"
    check(eng, ref, [a], [res])
    b = dict(a, state=a["state"].replace(WORDS * 3, "Totally different text follows the image now. " * 6))
    res = eng.answer([b])[0]
    assert res["path"] == "partial" and res["reused"] == inside[-1], (res, inside)
    check(eng, ref, [b], [res])
    assert eng.embeddings.stats["embed_hits"] >= 1  # the image tail from the embeddings cache, not the tower again
    assert eng.embeddings.stats["vision_runs"] == 1


def test_rope_of_equal_multimodal_positions_is_the_text_rope(model_dir):
    """[3, T] positions with three equal rows (text) give the 1-D rotary exactly; rows that differ change it."""
    eng = Engine(model_dir, device="cpu", dtype="float32")
    pos = torch.arange(5, 40)
    c1, s1 = eng.model.rope(pos)
    c3, s3 = eng.model.rope(pos.expand(3, -1))
    assert torch.equal(c1, c3) and torch.equal(s1, s3)
    p3 = pos.expand(3, -1).clone()
    p3[1] += 3
    assert not torch.equal(eng.model.rope(p3)[0], c1)


@pytest.fixture
def batch_graphs(monkeypatch):
    """statecache.run.batch's CUDA graphs on this machine (tests.triton_interp.batch_graphs_in_interpreter)."""
    from tests.triton_interp import batch_graphs_in_interpreter

    batch_graphs_in_interpreter(monkeypatch)


def graph_steps(eng: Engine, specialists=None):
    """The step loop over `eng`'s model with a batched runner in graph mode (the `batch_graphs` stand-ins) and a
    cache of its own."""
    from statecache.kernels.dispatch import TorchKernels
    from statecache.run.batch import BatchRunner

    runner = BatchRunner(eng.model, TorchKernels(), max_batch=4, graphs=True, triton=True, max_pos=1024,
                         tokens=(64, 128, 256), specialists=specialists)
    assert runner.use_graphs and runner.pad
    return make_steps(runner=runner, budget_tokens=256, mb=1024)


def step_row(steps, eng: Engine, raw: dict):
    """One raw row checked as the engine checks it (with its RowImages) and run through `steps` -> (its Answer, the
    checked row)."""
    from statecache.run.images import RowImages

    row = check_row(raw, eng.vocab_size, 4096, eng.tokenizer, eng.images, as_array=True)
    row["mm"] = RowImages(row["ids"], row["images"], eng.embeddings, eng.device)
    steps.add(0, row)
    got = []
    while steps.pending():
        got += steps.step()
    ((_, ans),) = got
    return ans, row


def replays(runner) -> int:
    return sum(g.graph.replays for g in runner.graphs.values() if g is not None)


def test_image_rows_through_replayed_graphs(batch_graphs, model_dir, ref):
    """Graph mode (stand-in graphs replaying the Triton batch kernels): the pieces holding the image run eagerly, the
    text pieces after it as the same batch graphs as text rows, their rotary shift in the graph's input buffer; cold,
    hit and grown rows answer as transformers."""
    eng = Engine(model_dir, device="cpu", dtype="float32", settings=CacheSettings(host_mb=0))
    steps = graph_steps(eng)
    state = f"{WORDS * 2}{PLACEHOLDER}{WORDS * 4}"
    raws = [{"state": state, "questions": [q(f"Question {k}?")], "images": [png(80)]} for k in range(2)]
    raws.append(dict(raws[0], state=state + "one more step was taken; " * 8))
    for raw, path in zip(raws, ["cold", "hit", "partial"]):
        before = replays(steps.runner)
        ans, row = step_row(steps, eng, raw)
        assert ans.path == path
        assert_close(ans.probs, reference(eng, ref, raw), TOL)
        if path != "cold":
            assert row["mm"].shift(row["state_len"]) != 0  # text after the image: positions are not the token index
            assert replays(steps.runner) > before  # its pieces (all past the image) replayed graphs
    assert steps.runner.stats["captures"] >= 1 and steps.runner.stats["capture_failed"] == 0


def test_tiny_vision_model_is_the_released_layout(model_dir, ref):
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["vision_config"]["out_hidden_size"] == cfg["text_config"]["hidden_size"]
    assert type(ref).__name__ == "Qwen3_5ForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert ids == [cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]]
    proc = AutoImageProcessor.from_pretrained(str(model_dir), use_fast=False)
    assert proc.patch_size == cfg["vision_config"]["patch_size"] and proc.merge_size == cfg["vision_config"]["spatial_merge_size"]
    # the token count of an image is the processor's own: patches // merge ** 2
    eng = Engine(model_dir, device="cpu", dtype="float32")
    for w, h in [(40, 24), (16, 28), (300, 200), (9, 9)]:
        ref_ = eng.images.prepare([png(90, w, h)])[0]
        assert ref_.n == proc.get_number_of_image_patches(h, w, {}) // proc.merge_size**2


def test_jpeg_and_webp_rows_answer(make, ref):
    eng = make(settings=CacheSettings(mb=0, host_mb=0))
    rows = [{"state": f"{WORDS}{PLACEHOLDER}", "questions": [q("Which?")], "images": [png(100 + k, fmt=f)]}
            for k, f in enumerate(["JPEG", "WEBP"])]
    res = eng.answer(rows)
    check(eng, ref, rows, res)


# ---- planting, specialists -----------------------------------------------------------------------------------------


def test_image_state_planted_in_one_piece_equals_one_planted_over_several_steps(model_dir):
    """A new image state's checkpoints kept inside one piece (snapshots of the eager image forward) equal those kept
    at the ends of 64-token pieces over several steps: their conv tails, GDN states and K/V (rotated at the
    multimodal positions), filed under the row's image key tokens, not its token ids."""
    from statecache.run.images import RowImages

    raw = {"state": f"{WORDS * 2}{PLACEHOLDER}{WORDS * 3}", "questions": [q("Which field?")], "images": [png(110)]}
    settings = CacheSettings(min_prefix=64, stride=64, host_mb=0)
    engines = [Engine(model_dir, device="cpu", dtype="float32", settings=settings, step_chunk=chunk)
               for chunk in (1024, 64)]
    res = [eng.answer([raw])[0] for eng in engines]
    assert [r["path"] for r in res] == ["cold", "cold"]
    assert_close(res[0]["probs"], res[1]["probs"], TOL)
    # one piece keeping its checkpoints (64, inside the image, 128, 192 and the state's end) inside it; 64-token
    # pieces up to the state's end, then the question
    assert [e.steps.stats["steps"] for e in engines] == [1, 5]
    eng = engines[0]
    row = check_row(raw, eng.vocab_size, 4096, eng.tokenizer, eng.images)
    mm = RowImages(row["ids"], row["images"], eng.embeddings, eng.device)
    got = {c.pos: c for c in engines[0].cache.index.lru_order()}
    want = {c.pos: c for c in engines[1].cache.index.lru_order()}
    assert sorted(got) == sorted(want) and len(got) >= 2 and any(p > row["images"][0].end for p in got)
    for pos, c in want.items():
        g = got[pos]
        assert list(g.group.tokens) == list(mm.keys[: len(g.group.tokens)]) != row["ids"][: len(g.group.tokens)]
        for a, b in zip(g.payload[:2], c.payload[:2]):
            assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
        for a, b in zip(g.group.payload[:2], c.group.payload[:2]):
            assert a.shape == b.shape and (a - b).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def vl_specialists(model_dir, tmp_path_factory):
    """A random 3-route specialists folder for the tiny model with a vision tower (adapters on the text layers); the
    router's bias keeps it off the trunk, so the image rows below pick both adapters."""
    from statecache.dev.specialists import make_specialists

    return make_specialists(model_dir, tmp_path_factory.mktemp("vl-spec"), routes=("trunk", "alpha", "beta"),
                            router_layer=2, seed=12, bias=[0.0, 3.0, 3.0])


def _spec_reference(eng: Engine, ref_, raw: dict) -> tuple[str, list[list[float]]]:
    row, _, kw = hf_inputs(eng, raw)
    route, probs = ref_.answers(row["ids"], row["slots"], row["options"], **kw)
    return ref_.names[route], probs


def test_image_rows_with_specialists(make, model_dir, vl_specialists):
    """Image rows with specialists, against transformers' Qwen3_5ForConditionalGeneration with peft's adapters and
    the router over its hidden states: cached (a new state, hit, grown state, another image; wrong route guesses
    forced, so rows rerun with the router's route) and plain (no cache, beside a text row)."""
    from tests.spec_util import SpecReference

    eng = make(specialists=vl_specialists)
    ref_ = SpecReference(model_dir, vl_specialists, eng.letter_ids)
    state = f"{WORDS * 3}{PLACEHOLDER}{WORDS * 2}"
    a = {"state": state, "questions": [q("Where is the button?")], "images": [png(120)]}
    grown = state + "scrolled down; " * 12
    rows = [a, dict(a, questions=[q("Is the form complete?", 2)]), dict(a, state=grown), dict(a, images=[png(121)]),
            dict(a, questions=[q("Next?", 4)]), dict(a, state=grown + "typed a name; " * 6)]
    wrong = iter([1, 2, 0, 1, 2, 0])
    own = eng.cache.guess
    eng.cache.guess = lambda best: (next(wrong) if best is not None else own(best))
    got = []
    for raw in rows:
        res = eng.answer([raw])[0]
        assert "probs" in res, res
        route, want = _spec_reference(eng, ref_, raw)
        assert res["route"] == route
        assert_close(res["probs"], want, TOL)
        got.append(res)
    assert {r["route"] for r in got} == {"alpha", "beta"}
    assert got[0]["path"] == "cold" and [r["path"] for r in got].count("hit") >= 2, got
    img_end = check_row(rows[-1], eng.vocab_size, 4096, eng.tokenizer, eng.images)["images"][0].end
    assert got[-1]["path"] == "partial" and got[-1]["reused"] > img_end  # a grown state, restored past the image
    assert eng.cache.stats["mispredict"] >= 2
    assert eng.embeddings.stats["vision_runs"] == 2
    assert eng.phases["step_rows"] == len(rows)
    for c in eng.cache.index.lru_order():  # a checkpoint's feature sum, under its image key tokens
        assert c.payload[2].shape == (eng.model.cfg.hidden_size,)

    plain = make(specialists=vl_specialists, settings=CacheSettings(mb=0, host_mb=0))
    batch = rows[:2] + [{"state": WORDS * 3, "questions": [q("Text only?")]}]
    res = plain.answer(batch)
    for raw, r in zip(batch, res):
        assert r["path"] == "plain"
        route, want = _spec_reference(plain, ref_, raw)
        assert r["route"] == route
        assert_close(r["probs"], want, TOL)


def test_image_rows_with_specialists_through_replayed_graphs(batch_graphs, model_dir, vl_specialists):
    """Stand-in batch graphs with specialists: the graphs' inputs carry both the route and the rotary shift; every
    route's image row, cold, hit and grown, with wrong route guesses forced, equals the eager engine's uncached
    answer and route."""
    eng = Engine(model_dir, device="cpu", dtype="float32", specialists=vl_specialists,
                 settings=CacheSettings(host_mb=0))
    steps = graph_steps(eng, eng.specialists)
    cache = steps.cache
    state = f"{WORDS * 2}{PLACEHOLDER}{WORDS * 4}"
    raws = [{"state": state, "questions": [q(f"Question {k}?")], "images": [png(130)]} for k in range(3)]
    raws.append(dict(raws[0], state=state + "one more step was taken; " * 8))
    guesses = iter([None, 1, 2, 0])
    own = cache.guess
    paths, routes = [], set()
    for raw in raws:
        g = next(guesses)
        cache.guess = lambda best, g=g: own(best) if g is None else g
        ans, row = step_row(steps, eng, raw)
        (want,) = eng.uncached([raw])
        (res,) = eng.answer([raw])  # the eager engine's route (and its answer: the uncached one's)
        assert eng.specialists.names[ans.route] == res["route"]
        assert_close(ans.probs, want, TOL)
        assert_close(res["probs"], want, TOL)
        paths.append(ans.path)
        routes.add(ans.route)
    # an adapter route (not the trunk) answers; the forced wrong guesses ran the graphs with the other routes first
    assert paths == ["cold", "hit", "hit", "partial"] and 0 not in routes, (paths, routes)
    assert cache.stats["mispredict"] >= 2
    assert replays(steps.runner) > 0
