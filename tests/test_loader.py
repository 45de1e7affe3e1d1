"""statecache.model.loader / statecache.model.config on checkpoints written by transformers (tests.oracle_util.CONFIGS).

Both layouts, single file and sharded; extra multi-token-prediction and vision weights are never read; a missing
weight or a config that is not Qwen3.5 fails with an error naming it; fused projections equal the concatenation of
the separate weights; bfloat16 loads keep A_log, dt_bias and the zero-centred norms in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from statecache.model import loader
from statecache.model.config import ConfigError, load_config, parse_config
from statecache.model.loader import CheckpointError, load_weights, weights_from_state_dict
from tests.oracle_util import CONFIGS, LETTERS, VOCAB, build_checkpoint

NAMES = {  # (layout, sharded, tied) -> a config of tests.oracle_util with it
    ("causal", False, False): "causal_untied_gqa2",
    ("causal", True, True): "causal_tied_sharded",
    ("conditional", False, True): "cond_tied_rot1",
    ("conditional", True, False): "cond_untied_sharded",
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """name -> a checkpoint folder, built once; tests that change files work on a copy (`copy_of`)."""
    root = tmp_path_factory.mktemp("pristine")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(root / name, name)
        return built[name]

    return get


@pytest.fixture
def copy_of(pristine, tmp_path):
    def copy(name: str) -> Path:
        out = tmp_path / name
        shutil.copytree(pristine(name), out)
        return out

    return copy


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def file_of(model_dir: Path, name: str) -> Path:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return model_dir / json.loads(index.read_text())["weight_map"][name]
    return model_dir / "model.safetensors"


def rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with `edit(dict)` applied to its tensors (metadata kept)."""
    with safe_open(str(path), "pt") as h:
        meta = h.metadata()
        sd = {k: h.get_tensor(k) for k in h.keys()}
    edit(sd)
    save_file(sd, str(path), metadata=meta)


def prefix(layout: str) -> str:
    return "model." if layout == "causal" else "model.language_model."


def assert_same_weights(a: loader.Weights, b: loader.Weights) -> None:
    def flat(w):
        out = {"embed": w.embed, "final_norm": w.final_norm, "head_w": w.head_w}
        for i, L in enumerate(w.layers):
            for f in ("in_norm", "post_norm", "gate_up_w", "down_w"):
                out[f"{i}.{f}"] = getattr(L, f)
            for f, v in vars(L.mixer).items():
                out[f"{i}.mixer.{f}"] = v
        return out

    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and torch.equal(fa[k], fb[k]), k


# ---- layouts, extra weights ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(NAMES), ids=["-".join(map(str, k)) for k in NAMES])
def test_layouts_load(pristine, key):
    layout, sharded, tied = key
    path = pristine(NAMES[key])
    assert (path / "model.safetensors.index.json").is_file() == sharded
    cfg = load_config(path)
    assert cfg.weight_prefix == prefix(layout) and cfg.tie_word_embeddings == tied
    fields = CONFIGS[NAMES[key]][2]
    assert cfg.hidden_size == fields["hidden_size"] and cfg.num_layers == fields["num_hidden_layers"]
    assert cfg.partial_rotary_factor == fields["rope_parameters"]["partial_rotary_factor"]
    assert cfg.rope_theta == fields["rope_parameters"]["rope_theta"]
    w = load_weights(path, LETTERS)
    assert len(w.layers) == cfg.num_layers and [L.kind for L in w.layers] == list(cfg.layer_types)
    assert w.head_w.shape == (cfg.vocab_size, cfg.hidden_size) and w.letter_ids.shape == (26,)


@pytest.mark.parametrize("name", ["cond_tied_rot1", "cond_untied_sharded"])
def test_conditional_ignores_mtp_and_vision_weights(pristine, copy_of, name, monkeypatch):
    path = copy_of(name)
    before = load_weights(pristine(name), LETTERS)
    target = file_of(path, "lm_head.weight" if not CONFIGS[name][2]["tie_word_embeddings"]
                     else "model.language_model.norm.weight")
    extra = {"mtp.fc.weight": torch.randn(7, 5),
             "mtp.layers.0.mlp.up_proj.weight": torch.randn(3, 4, dtype=torch.bfloat16)}
    rewrite(target, lambda sd: sd.update(extra))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({k: target.name for k in extra})
        index.write_text(json.dumps(data))
    names = tensors(path)
    assert "mtp.fc.weight" in names and any(k.startswith("model.visual.") for k in names)

    read = []
    get = loader._Files.get
    monkeypatch.setattr(loader._Files, "get", lambda self, n, dt: (read.append(n), get(self, n, dt))[1])
    after = load_weights(path, LETTERS)
    assert read and not [n for n in read if n.startswith(("mtp.", "model.visual."))]
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in read)
    assert_same_weights(before, after)


def test_every_text_weight_is_read_once(pristine, monkeypatch):
    """All the text model's tensors in the checkpoint are used, each read once (nothing silently ignored)."""
    name = "cond_untied_sharded"
    path = pristine(name)
    read = []
    get = loader._Files.get
    monkeypatch.setattr(loader._Files, "get", lambda self, n, dt: (read.append(n), get(self, n, dt))[1])
    load_weights(path, LETTERS)
    text = {k for k in tensors(path) if not k.startswith("model.visual.")}
    assert sorted(read) == sorted(text)


# ---- errors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,missing", [
    ("causal_untied_gqa2", "model.layers.1.linear_attn.A_log"),
    ("causal_untied_gqa2", "lm_head.weight"),
    ("causal_tied_sharded", "model.layers.3.self_attn.k_norm.weight"),
    ("cond_untied_sharded", "model.language_model.embed_tokens.weight"),
    ("cond_tied_rot1", "model.language_model.layers.4.mlp.up_proj.weight"),
    ("cond_tied_rot1", "model.language_model.layers.2.linear_attn.in_proj_b.weight"),
])
def test_missing_weight_is_named(copy_of, name, missing):
    path = copy_of(name)
    index = path / "model.safetensors.index.json"
    rewrite(file_of(path, missing), lambda sd: sd.pop(missing))
    if index.is_file():
        data = json.loads(index.read_text())
        del data["weight_map"][missing]
        index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_weights(path, LETTERS)


def test_no_weight_files(copy_of):
    path = copy_of("causal_untied_gqa2")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_weights(path, LETTERS)


def test_embedding_shape_must_match_config(copy_of):
    path = copy_of("causal_untied_gqa2")
    raw = json.loads((path / "config.json").read_text())
    raw["vocab_size"] += 1
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_weights(path, LETTERS)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next", "qwen3", None])
def test_not_a_qwen3_5_config(copy_of, model_type):
    path = copy_of("causal_untied_gqa2")
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="model_type"):
        load_weights(path, LETTERS)


def test_config_errors(copy_of, tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_config(tmp_path)  # no config.json
    path = copy_of("cond_tied_rot1")
    raw = json.loads((path / "config.json").read_text())
    bad = json.loads(json.dumps(raw))
    del bad["text_config"]["num_hidden_layers"]
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ConfigError, match="yarn"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["layer_types"][1] = "sliding_attention"
    with pytest.raises(ConfigError, match="sliding_attention"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["attention_bias"] = True
    with pytest.raises(ConfigError, match="attention_bias"):
        parse_config(bad)
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(ConfigError, match="gelu"):
        parse_config(bad)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_reads_as_transformers_does(pristine, name):
    """Every field statecache takes from config.json has the value transformers' own config class gives it."""
    from transformers import AutoConfig

    path = pristine(name)
    ours = load_config(path)
    full = AutoConfig.from_pretrained(path)
    hf = full.get_text_config()
    assert ours.layer_types == tuple(hf.layer_types)
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps"):
        assert getattr(ours, f) == getattr(hf, f), f
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert ours.tie_word_embeddings == full.tie_word_embeddings  # the top-level flag (conditional layout)


@pytest.mark.parametrize("n,interval", [(4, None), (5, None), (8, None), (6, 2), (7, 3), (3, 1)])
def test_layer_types_default_pattern(n, interval):
    """A config without layer_types: full attention every `full_attention_interval` (4) layers, as transformers."""
    from transformers import Qwen3_5TextConfig

    raw = dict(model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=n,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    if interval is not None:
        raw["full_attention_interval"] = interval
    want = Qwen3_5TextConfig.from_dict(dict(raw)).layer_types
    assert parse_config(raw).layer_types == tuple(want)
    assert parse_config({"model_type": "qwen3_5", "text_config": raw}).layer_types == tuple(want)


# ---- tied heads, dtypes, fusion -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["causal_tied_sharded", "cond_tied_rot1"])
def test_tied_checkpoint_has_no_lm_head_and_loads(pristine, name):
    path = pristine(name)
    assert "lm_head.weight" not in tensors(path)
    w = load_weights(path, LETTERS)
    assert w.head_w is w.embed and w.letter_ids.tolist() == list(LETTERS)


@pytest.mark.parametrize("name", ["causal_untied_gqa2", "cond_untied_sharded"])
def test_untied_head_rows_are_the_letters(pristine, name):
    path = pristine(name)
    head = tensors(path)["lm_head.weight"]
    w = load_weights(path, LETTERS)
    assert torch.equal(w.head_w, head)
    assert not torch.equal(w.head_w, w.embed)


@pytest.mark.parametrize("name", ["causal_tied_sharded", "cond_untied_sharded"])
def test_bfloat16_keeps_gates_and_norms_float32(pristine, name):
    w = load_weights(pristine(name), LETTERS, "cpu", torch.bfloat16)
    f32, bf16 = torch.float32, torch.bfloat16
    assert w.embed.dtype == bf16 and w.head_w.dtype == bf16 and w.final_norm.dtype == f32
    for L in w.layers:
        assert L.in_norm.dtype == f32 and L.post_norm.dtype == f32
        assert L.gate_up_w.dtype == bf16 and L.down_w.dtype == bf16
        m = L.mixer
        if L.kind == "linear_attention":
            assert m.A_log.dtype == f32 and m.dt_bias.dtype == f32
            assert m.in_w.dtype == bf16 and m.conv_w.dtype == bf16 and m.out_w.dtype == bf16
            assert m.norm_w.dtype == bf16  # the gated norm's plain weight: model dtype (as transformers has it)
        else:
            assert m.q_norm.dtype == f32 and m.k_norm.dtype == f32
            assert m.qkv_w.dtype == bf16 and m.o_w.dtype == bf16
    w32 = load_weights(pristine(name), LETTERS)
    assert torch.equal(w.layers[0].in_norm, w32.layers[0].in_norm)  # float32 norms are not rounded through bf16
    lin = w.layers[w.cfg.linear_layers[0]].mixer
    assert torch.equal(lin.A_log, w32.layers[w.cfg.linear_layers[0]].mixer.A_log)


@pytest.mark.parametrize("name", ["causal_untied_gqa2", "cond_untied_sharded", "causal_untied_rot1"])
def test_fused_weights_are_the_separate_ones(pristine, name):
    path = pristine(name)
    sd = tensors(path)
    w = load_weights(path, LETTERS)
    cfg = w.cfg
    p = cfg.weight_prefix
    assert torch.equal(w.embed, sd[p + "embed_tokens.weight"])
    assert torch.equal(w.final_norm, 1 + sd[p + "norm.weight"])
    for i, L in enumerate(w.layers):
        q = f"{p}layers.{i}."
        assert torch.equal(L.in_norm, 1 + sd[q + "input_layernorm.weight"])
        assert torch.equal(L.post_norm, 1 + sd[q + "post_attention_layernorm.weight"])
        assert torch.equal(L.gate_up_w, torch.cat([sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"]]))
        assert torch.equal(L.down_w, sd[q + "mlp.down_proj.weight"])
        m = L.mixer
        if L.kind == "linear_attention":
            la = q + "linear_attn."
            parts = [sd[la + s + ".weight"] for s in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
            assert [t.shape[0] for t in parts] == [cfg.conv_dim, cfg.value_dim, cfg.linear_num_value_heads,
                                                   cfg.linear_num_value_heads]
            assert torch.equal(m.in_w, torch.cat(parts))
            assert torch.equal(m.conv_w, sd[la + "conv1d.weight"][:, 0, :])
            assert m.conv_w.shape == (cfg.conv_dim, cfg.linear_conv_kernel_dim)
            for f in ("A_log", "dt_bias"):
                assert torch.equal(getattr(m, f), sd[la + f])
            assert torch.equal(m.norm_w, sd[la + "norm.weight"])  # plain weight, not 1 + w
            assert torch.equal(m.out_w, sd[la + "out_proj.weight"])
        else:
            sa = q + "self_attn."
            assert torch.equal(m.qkv_w, torch.cat([sd[sa + s + ".weight"] for s in ("q_proj", "k_proj", "v_proj")]))
            assert m.qkv_w.shape[0] == (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
            assert torch.equal(m.q_norm, 1 + sd[sa + "q_norm.weight"])
            assert torch.equal(m.k_norm, 1 + sd[sa + "k_norm.weight"])
            assert torch.equal(m.o_w, sd[sa + "o_proj.weight"])


def test_state_dict_source_equals_files(pristine):
    """weights_from_state_dict (transformers' own model's state dict) builds the same weights as the files."""
    from statecache.dev.checkpoints import load_reference

    path = pristine("cond_untied_sharded")
    ref = load_reference(path)
    sd = {k: v.detach() for k, v in ref.state_dict().items()}
    assert_same_weights(weights_from_state_dict(load_config(path), sd, LETTERS), load_weights(path, LETTERS))
