"""Random Qwen3.5 checkpoints made by transformers (both layouts, sharded or not, tied or not) and the tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from statecache.dev import checkpoints, tiny
from statecache.dev.checkpoints import checkpoint_layout, load_reference, make_checkpoint, real_shape

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, vocab_size=97)
LETTERS = list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def saved_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@pytest.mark.parametrize("layout", ["causal", "conditional"])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_loads_with_transformers(tmp_path, layout, sharded, tied):
    out = make_checkpoint(tmp_path / "ckpt", layout=layout, seed=3, max_shard_bytes=40_000 if sharded else None,
                          tie_word_embeddings=tied, **SMALL)
    index = out / "model.safetensors.index.json"
    assert index.is_file() == sharded
    assert (out / "model.safetensors").is_file() != sharded
    if sharded:
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1

    config = json.loads((out / "config.json").read_text())
    prefix = "model." if layout == "causal" else "model.language_model."
    if layout == "causal":
        assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
        assert config["tie_word_embeddings"] == tied
    else:
        assert config["model_type"] == "qwen3_5" and config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
        assert config["tie_word_embeddings"] == tied  # the top-level one is what transformers ties by
        assert config["text_config"]["model_type"] == "qwen3_5_text"
    assert checkpoint_layout(out) == layout

    weights = saved_tensors(out)
    assert all(k.startswith(("model.", "lm_head.")) for k in weights)
    assert any(k.startswith("model.visual.") for k in weights) == (layout == "conditional")
    for name in ["embed_tokens.weight", "norm.weight", "layers.0.linear_attn.A_log", "layers.0.linear_attn.dt_bias",
                 "layers.0.linear_attn.conv1d.weight", "layers.0.linear_attn.norm.weight",
                 "layers.0.linear_attn.in_proj_qkv.weight", "layers.0.linear_attn.in_proj_z.weight",
                 "layers.0.linear_attn.in_proj_a.weight", "layers.0.linear_attn.in_proj_b.weight",
                 "layers.3.self_attn.q_proj.weight", "layers.3.self_attn.q_norm.weight",
                 "layers.3.self_attn.k_norm.weight", "layers.3.mlp.down_proj.weight"]:
        assert prefix + name in weights, name
    assert ("lm_head.weight" in weights) != tied
    # every parameter was perturbed: RMSNorm weights (zero-centred) are no longer 0, the gated norm no longer 1
    assert weights[prefix + "layers.0.input_layernorm.weight"].abs().min() > 0
    assert not torch.equal(weights[prefix + "layers.0.linear_attn.norm.weight"], torch.ones(SMALL["linear_value_head_dim"]))
    assert all(t.dtype == torch.float32 for t in weights.values())

    ref = load_reference(out)
    assert type(ref).__name__ == ("Qwen3_5ForCausalLM" if layout == "causal" else "Qwen3_5ForConditionalGeneration")
    assert not ref.training
    state = ref.state_dict()
    for k, v in weights.items():
        assert torch.equal(state[k], v), k
    embed = ref.get_input_embeddings().weight
    assert (ref.lm_head.weight.data_ptr() == embed.data_ptr()) == tied
    if not tied:
        assert not torch.equal(ref.lm_head.weight, embed)
    with torch.no_grad():
        logits = ref(torch.tensor([[1, 5, 7, 11, 2, 3]])).logits
    assert logits.shape == (1, 6, SMALL["vocab_size"]) and torch.isfinite(logits).all()


def test_seed_reproduces_and_changes_weights(tmp_path):
    rng = torch.get_rng_state()
    a = saved_tensors(make_checkpoint(tmp_path / "a", seed=1, **SMALL))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left as it was
    b = saved_tensors(make_checkpoint(tmp_path / "b", seed=1, **SMALL))
    c = saved_tensors(make_checkpoint(tmp_path / "c", seed=2, **SMALL))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_config_fields_pass_through(tmp_path):
    rope = dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.5, mrope_section=[2, 1, 1],
                mrope_interleaved=True)
    fields = dict(SMALL, rope_parameters=rope, rms_norm_eps=1e-5, linear_conv_kernel_dim=3,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
    out = make_checkpoint(tmp_path / "c", layout="conditional", **fields)
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["rope_parameters"] == rope and rope == fields["rope_parameters"]  # caller's dict untouched
    assert text["layer_types"] == fields["layer_types"]
    assert text["rms_norm_eps"] == 1e-5 and text["linear_conv_kernel_dim"] == 3
    weights = saved_tensors(out)
    assert weights["model.language_model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 3
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in weights


def test_tokenizer_files_are_copied(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    out = make_checkpoint(tmp_path / "c", tokenizer_dir=tiny_dir, **SMALL)
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids(LETTERS) == \
        AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(LETTERS)


def test_real_shapes():
    nine = real_shape("9B")
    assert (nine["hidden_size"], nine["num_hidden_layers"], nine["num_attention_heads"], nine["num_key_value_heads"],
            nine["head_dim"], nine["intermediate_size"]) == (4096, 32, 16, 4, 256, 12288)
    assert (nine["linear_num_key_heads"], nine["linear_num_value_heads"], nine["linear_key_head_dim"],
            nine["linear_value_head_dim"], nine["vocab_size"]) == (16, 32, 128, 128, 248320)
    assert nine["rope_parameters"]["mrope_section"] == [11, 11, 10] and nine["rope_parameters"]["rope_theta"] == 1e7
    assert not nine["tie_word_embeddings"]
    assert real_shape("Qwen3.5-0.8B")["hidden_size"] == 1024 and real_shape("2b")["hidden_size"] == 2048
    for name in ["0.8B", "2B", "9B"]:
        shape = real_shape(name)
        assert shape["layer_types"].count("full_attention") * 4 == shape["num_hidden_layers"]
        from transformers import Qwen3_5TextConfig

        assert Qwen3_5TextConfig(**shape).layer_types == shape["layer_types"]
    real_shape("9B")["rope_parameters"]["rope_theta"] = 0
    assert real_shape("9B")["rope_parameters"]["rope_theta"] == 1e7  # each call gives a fresh dict
    with pytest.raises(KeyError):
        real_shape("27B")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("STATECACHE_HOME", str(tmp_path_factory.mktemp("home")))
    try:
        yield tiny.tiny_model_dir()
    finally:
        mp.undo()


def test_tiny_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok.convert_tokens_to_ids(LETTERS)
    assert len(set(ids)) == 26 and tok.unk_token_id not in ids and all(0 <= i < len(tok) for i in ids)
    for letter, i in zip(LETTERS, ids):
        assert tok.encode(letter, add_special_tokens=False) == [i]
    for text in ["The agent clicks option C.", "Prix: 12,99 € — naïve café ✓\n\ttabs", "ABCDEFG xyz 0123"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    specials = [tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS]
    assert tok.encode("<|im_start|>user<|im_end|><|endoftext|>", add_special_tokens=False) == \
        [specials[1], *tok.encode("user", add_special_tokens=False), specials[2], specials[0]]
    assert tok.eos_token == "<|im_end|>"
    messages = [{"role": "system", "content": "Answer with a letter."}, {"role": "user", "content": "A or B?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nAnswer with a letter.<|im_end|>\n<|im_start|>user\nA or B?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, tokenize=False).endswith("assistant\n")
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tok) and config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]


def test_tiny_model_dir_is_idempotent(tiny_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    monkeypatch.setattr(tiny, "_build", lambda d: pytest.fail("rebuilt an existing tiny model"))
    assert tiny.tiny_model_dir() == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny.NAME]  # no temporary folders left behind


def test_tiny_model_dir_race(tmp_path, monkeypatch):
    """Another process renames its copy into place while this one builds: both end with one whole folder."""
    monkeypatch.setenv("STATECACHE_HOME", str(tmp_path))
    build = tiny._build

    def racing_build(out_dir):
        build(out_dir)
        monkeypatch.setattr(tiny, "_build", build)
        assert tiny.tiny_model_dir() == tmp_path / tiny.NAME  # the other process wins

    monkeypatch.setattr(tiny, "_build", racing_build)
    assert tiny.tiny_model_dir() == tmp_path / tiny.NAME
    assert [p.name for p in tmp_path.iterdir()] == [tiny.NAME]
    assert (tmp_path / tiny.NAME / "model.safetensors").is_file()


def test_tiny_reference_runs(tiny_dir):
    ref = load_reference(tiny_dir)
    with torch.no_grad():
        logits = ref(torch.arange(70).unsqueeze(0)).logits
    assert logits.shape == (1, 70, ref.config.vocab_size) and torch.isfinite(logits).all()
    assert checkpoints.checkpoint_layout(tiny_dir) == "causal"


# A stand-in for flash-linear-attention installed on a GPU host: its kernels are Triton's, which cannot read CPU
# tensors (the message is the one Triton gives). transformers binds them when its Qwen3.5 code is imported.
_FLA_STUB = '''
def _triton(*args, **kwargs):
    raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

chunk_gated_delta_rule = fused_recurrent_gated_delta_rule = _triton
'''


def test_tiny_folders_build_on_a_gpu_host_with_fla(tmp_path, tiny_dir):
    """`python -m statecache.dev.tiny specialists` on a host where CUDA is available and fla imports (both simulated in
    a fresh process): the specialists folder is built on the CPU (a forward of the tiny model for the router) through
    transformers' torch code, never handing CPU tensors to fla's kernels; a reference loaded there answers too."""
    import shutil
    import subprocess
    import sys

    stub = tmp_path / "site"
    (stub / "fla" / "ops" / "gated_delta_rule").mkdir(parents=True)
    (stub / "fla" / "__init__.py").write_text("")
    (stub / "fla" / "ops" / "__init__.py").write_text("")
    (stub / "fla" / "ops" / "gated_delta_rule" / "__init__.py").write_text(_FLA_STUB)
    home = tmp_path / "home"
    shutil.copytree(tiny_dir, home / tiny.NAME)  # the model itself is copied: only the specialists are built
    code = ("import runpy, sys, torch; torch.cuda.is_available = lambda: True; import fla.ops.gated_delta_rule; "
            "sys.argv = ['statecache.dev.tiny', 'specialists']; runpy.run_module('statecache.dev.tiny', run_name='__main__'); "
            "from statecache.dev.checkpoints import load_reference; from statecache.dev.tiny import tiny_model_dir; "
            "print(load_reference(tiny_model_dir())(torch.arange(70)[None]).logits.shape)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "STATECACHE_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(stub), str(root)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (home / (tiny.NAME + "-specialists") / "router.json").is_file()
    assert done.stdout.split() == [str(home / (tiny.NAME + "-specialists")), "torch.Size([1,", "70,", f"{tiny.VOCAB_SIZE}])"]


def test_hf_qwen3_5_refuses_the_other_binding():
    """transformers binds its GDN kernels once per process (a fresh one here): after the kernels were asked for,
    asking for the torch path raises a clear error (a CPU forward would otherwise reach Triton's); kernels=None
    takes the module as it is. (The other way round raises the same way.)"""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for first, then in (("True", "False"),):
        code = (f"from statecache.model.hf import hf_qwen3_5\nm = hf_qwen3_5(kernels={first})\n"
                f"assert hf_qwen3_5(kernels=None) is m and hf_qwen3_5(kernels={first}) is m\n"
                f"try:\n    hf_qwen3_5(kernels={then})\nexcept RuntimeError as e:\n    print('refused:', e)\n")
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(root)})
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith("refused: transformers' Qwen3.5 code was imported"), done.stdout
