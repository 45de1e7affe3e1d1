"""bench/random_checkpoint.py writes a checkpoint both statecache's loader and transformers read, and they agree."""

import importlib.util
import json
from pathlib import Path

import torch

from statecache.dev.checkpoints import load_reference
from statecache.cache.config import CacheSettings
from statecache.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("random_checkpoint", ROOT / "bench" / "random_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
             vocab_size=600)


def test_random_checkpoint_loads_in_both(tmp_path):
    rc = _module()
    cfg = rc.text_config("0.8B", layers=4, **SMALL)
    shapes = rc.weight_shapes(cfg)
    out = rc.write_checkpoint(tmp_path / "ck", cfg, seed=1, shard_bytes=40_000, device="cpu", dtype=torch.float32)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(shapes)
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_text"

    ref = load_reference(out)  # transformers: every weight present (from_pretrained would warn and init missing ones)
    sd = ref.state_dict()
    from safetensors.torch import load_file

    for f in set(index["weight_map"].values()):
        for name, t in load_file(str(out / f)).items():
            assert torch.equal(sd[name], t), name
    a_log = sd["model.layers.0.linear_attn.A_log"]
    assert torch.all(a_log >= 0) and torch.all(a_log <= torch.log(torch.tensor(16.0)))

    eng = Engine(out, "cpu", "float32", settings=CacheSettings(mb=64))  # statecache's loader, and the tokenizer's letters
    ids = [int(x) for x in torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(0))]
    row = {"ids": ids, "state_len": 290, "slots": [299], "nopts": [4]}
    ours = eng.answer([row])[0]["probs"][0]
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, 299, eng.letter_ids[:4]]
    want = torch.softmax(logits.double(), -1).tolist()
    assert max(abs(a - b) for a, b in zip(ours, want)) < 1e-4
