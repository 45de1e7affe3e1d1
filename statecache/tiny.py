"""The built-in tiny model: a small random Qwen3.5 checkpoint in the real Hugging Face layout, with its own tokenizer.

It lets the worker, the demo and the tests run anywhere in seconds. Its weights are random, so its answers mean
nothing; only their agreement with the reference does. Made once into ``$STATECACHE_HOME/tiny-v1`` (default
``~/.cache/statecache/tiny-v1``): built in a temporary folder beside it, then renamed into place, so a reader
never sees half a model and two processes racing to make it both end up with one whole copy.

``python -m statecache.tiny`` prints the folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .checkpoints import make_checkpoint

NAME = "tiny-v1"
SEED = 0
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512

# The standard Qwen3.5 pattern (3 Gated DeltaNet layers, then 1 gated attention layer) at toy width. head_dim 32
# with partial rotary 0.25 rotates 8 dims (4 frequencies), split over the three M-RoPE sections as in the real
# model's [11, 11, 10] of 32.
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
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


def statecache_home() -> Path:
    """``$STATECACHE_HOME``, else ``~/.cache/statecache``."""
    from .settings import env_home

    return Path(env_home() or Path.home() / ".cache" / "statecache")


def build_tokenizer():
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) learnt from ``TRAINING_TEXT``: every byte is a
    token, so each letter A-Z is a single token; ChatML special tokens and chat template as Qwen's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE,
                                   model_max_length=SHAPE["max_position_embeddings"])


def _build(out_dir: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    make_checkpoint(out_dir, layout="causal", seed=SEED, vocab_size=len(tokenizer),
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **SHAPE)


def tiny_model_dir(home: str | Path | None = None) -> Path:
    """The tiny model's folder under `home` (default: `statecache_home()`), made on first use (atomically; safe
    when processes race)."""
    home = Path(home) if home else statecache_home()
    final = home / NAME
    if (final / "config.json").is_file():
        return final
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=home))
    try:
        _build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # someone else renamed theirs into place first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(tiny_model_dir())
