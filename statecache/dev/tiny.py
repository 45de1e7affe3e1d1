"""The built-in tiny model: a small random Qwen3.5 checkpoint in the real Hugging Face layout, with its own tokenizer.

It lets the worker, the demo and the tests run anywhere in seconds. Its weights are random, so its answers mean
nothing; only their agreement with the reference does. Made once into ``$STATECACHE_HOME/tiny-v3`` (default
``~/.cache/statecache/tiny-v3``): built in a temporary folder beside it, then renamed into place, so a reader
never sees half a model and two processes racing to make it both end up with one whole copy.

``tiny_vl_model_dir()`` is the same model in the released multimodal layout (``Qwen3_5ForConditionalGeneration``) with
a tiny vision tower, an image processor config and the image tokens in its tokenizer (``tiny-vl-v1``): image rows.
``tiny_specialists_dir()`` makes (the same way, once) a random specialists folder for the text model: three routes
(the trunk and two PEFT LoRA adapters written by peft's own ``save_pretrained``), router at layer 2.

``python -m statecache.dev.tiny`` prints the model's folder (``--vision``: the multimodal one);
``python -m statecache.dev.tiny specialists`` the specialists'.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from statecache.dev.checkpoints import make_checkpoint
from statecache.settings import statecache_home

NAME = "tiny-v3"  # v2: " A".." Z" are single tokens (text rows' answer slots read them after the cue); v3: GDN keys
# of 64 dims (the batched delta kernel's 64-token blocks need key slices of 64 on CUDA: the GPU suite runs the step
# loop on this model)
VL_NAME = "tiny-vl-v3"
IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]  # as in the released Qwen3.5 tokenizers
# the tiny vision tower: 2-pixel patches merged 2x2, so an image of up to 32x32 pixels is at most 64 tokens
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, temporal_patch_size=2,
              spatial_merge_size=2, num_position_embeddings=16)
VL_MAX_PIXELS, VL_MIN_PIXELS = 32 * 32, 8 * 8
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512

# The standard Qwen3.5 pattern (3 Gated DeltaNet layers, then 1 gated attention layer) at toy width. head_dim 32
# with partial rotary 0.25 rotates 8 dims (4 frequencies), split over the three M-RoPE sections as in the real
# model's [11, 11, 10] of 32.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
             max_position_embeddings=32768,
             rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                  mrope_section=[2, 1, 1], mrope_interleaved=True))

# Qwen's ChatML, text only: each message as <|im_start|>role\ncontent<|im_end|>\n, then the assistant's turn.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.content is string -%}{%- set text = m.content -%}"
    "{%- else -%}{%- set text = m.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# The same with images: an image item renders as Qwen's <|vision_start|><|image_pad|><|vision_end|>.
VL_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.content is string -%}{{- m.content -}}"
    "{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif c.type == 'text' -%}{{- c.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# What the tokenizer learns its merges from: plain English about agents, pages and choices, a few KB.
TRAINING_TEXT = """\
An agent opens a page, reads what is on it, and decides what to do next. The page may be a shop, a form, a map
or a long article. The agent keeps a short record of its goal and of the steps it has taken so far: it clicked a
button, it typed a name into a field, it scrolled down to the bottom, it went back to the previous page.
Before each step the agent asks a question about its current state. Which link leads to the checkout? Is the
form complete? Did the search return the item we wanted? Each question has a few options, marked with the
letters A, B, C and D, sometimes more. The model reads the state and the question and gives a probability to
every letter. The answer is the letter with the highest probability, but the whole distribution is useful too:
when two options are close, the agent may look again before it acts.
Option A: click the blue button at the top of the page. Option B: fill in the email address. Option C: open the
menu on the left. Option D: wait for the page to finish loading. Option E: go back. Option F: stop and report.
Questions come one at a time, and most of them share a long beginning with the question before. The same page
is asked about again and again; a new step is added at the end of the history; a new page replaces the old one
in the middle while the goal and the earlier steps stay the same. Work that was done once should not be done a
second time. A state that was computed for one question can be kept and used for the next.
The weather today is mild, with clouds in the morning and sun in the afternoon. A train leaves the station at
nine and arrives in the city before eleven. The library is open from Monday to Saturday; on Sunday it is closed.
She bought bread, milk, apples and a small jar of honey, then walked home along the river.
Numbers appear on many pages: prices like 12.99 or 450, dates like 2024-05-17, quantities such as 3 items or
10 kilograms, and codes like X7Q or ZIP 90210. A careful reader checks each one.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft
zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789
Answer with a single letter. The correct answer is B. The best choice here is C, because the form is not yet
complete. If none of the options fits, choose the last one. Think about the goal first, then about the page.
The user wants to book a table for two at a restaurant near the park, on Friday evening, at seven o'clock. The
agent has found three restaurants. The first has no free table. The second is far from the park. The third has
a table at seven and is close. Which restaurant should the agent choose? A: the first. B: the second. C: the
third. D: none of them.
Questions, answers, pages, links, buttons, fields, menus, steps, goals, states, options and letters: these are
the words an agent uses most. The system describes the task; the user gives the state and the question; the
assistant answers.
"""


def build_tokenizer(vision: bool = False):
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) learnt from ``TRAINING_TEXT``: every byte is a
    token, so each letter A-Z is a single token, and each space-prefixed letter " A".." Z" is one too (merges put in
    place of the last ones where the text did not teach them: what a byte-level BPE writes after "Answer:", as
    Qwen's does);
    ChatML special tokens and chat template as Qwen's. vision: also
    the image tokens (``IMAGE_TOKENS``) and a chat template that renders image items."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = SPECIAL_TOKENS + (IMAGE_TOKENS if vision else [])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    tok = with_spaced_letters(tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=specials, chat_template=VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
                                   model_max_length=SHAPE["max_position_embeddings"])


def with_spaced_letters(tok):
    """The trained tokenizer with a merge "Ġ" + letter for every capital letter whose " L" it lacks, in place of its
    last (rarest) merges, so the vocabulary keeps its size (and the tiny model the same weights)."""
    import json
    import string

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    missing = [c for c in string.ascii_uppercase if "\u0120" + c not in vocab]
    while True:  # drop the last len(missing) merges (their tokens are the highest ids); a dropped " L" is missing too
        size = len(vocab)
        top = sorted(vocab.items(), key=lambda kv: kv[1])[size - len(missing):] if missing else []
        lost = [t[1:] for t, _ in top if len(t) == 2 and t[0] == "\u0120" and t[1] in string.ascii_uppercase]
        if not lost:
            break
        missing += [c for c in lost if c not in missing]
        missing = [c for c in string.ascii_uppercase if c in missing]
        if len(missing) > 26:
            break
    if missing:
        first = size - len(missing)
        vocab = {t: i for t, i in vocab.items() if i < first}
        del merges[len(merges) - len(missing):]
        for k, letter in enumerate(missing):
            vocab["\u0120" + letter] = first + k
            merges.append(["\u0120", letter] if not merges or isinstance(merges[0], list) else f"\u0120 {letter}")
        spec["model"]["vocab"] = vocab
    return Tokenizer.from_str(json.dumps(spec))


def _build(out_dir: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    make_checkpoint(out_dir, layout="causal", seed=SEED, vocab_size=len(tokenizer),
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **SHAPE)


def _build_vl(out_dir: Path) -> None:
    tokenizer = build_tokenizer(vision=True)
    tokenizer.save_pretrained(out_dir)
    start, pad, end = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)
    make_checkpoint(out_dir, layout="conditional", seed=SEED, vocab_size=len(tokenizer),
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), vision_config=VISION,
                    image_tokens=dict(image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end),
                    max_pixels=VL_MAX_PIXELS, min_pixels=VL_MIN_PIXELS, **SHAPE)


def _build_specialists(out_dir: Path) -> None:
    from statecache.dev.specialists import make_specialists

    # alpha: every projection of layers 3-7; beta: a few projections of layers 4, 5 and 7, ranks and alphas varied
    beta = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "in_proj_z", "out_proj", "gate_proj", "down_proj"],
                layers_to_transform=[4, 5, 7], rank_pattern={"gate_proj": 3}, alpha_pattern={"down_proj": 2})
    make_specialists(tiny_model_dir(), out_dir, routes=("trunk", "alpha", "beta"), router_layer=2,
                     adapters={"beta": beta}, seed=SEED)


def tiny_model_dir(home: str | Path | None = None) -> Path:
    """The tiny model's folder under `home` (default: `statecache_home()`), made on first use (atomically; safe
    when processes race)."""
    return _made(NAME, "config.json", _build, home)


def tiny_vl_model_dir() -> Path:
    """The tiny model with a vision tower (conditional layout), made on first use like tiny_model_dir."""
    return _made(VL_NAME, "config.json", _build_vl)


def tiny_specialists_dir() -> Path:
    """A random specialists folder for the tiny model (3 routes), made on first use like the model."""
    return _made(NAME + "-specialists", "router.json", _build_specialists)


def _made(name: str, marker: str, build, home: str | Path | None = None) -> Path:
    home = Path(home) if home else statecache_home()
    final = home / name
    if (final / marker).is_file():
        return final
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=home))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # someone else renamed theirs into place first
            if not (final / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    print(tiny_specialists_dir() if args == ["specialists"] else tiny_vl_model_dir() if "--vision" in args
          else tiny_model_dir())
