"""A Hugging Face GPT-2 directory in and out (capstone.gpt2.hf, docs/gpt2.md): `--init-from DIR` reads
config.json + model.safetensors (both key sets) without torch, refuses what capstone cannot
compute, crops the positions to --seq-len; `prepare --tokenizer-from DIR` tokenizes with its
vocab.json + merges.txt. The round trip runs transformers in the torch venv (TORCH_PYTHON): a tiny
tied GPT-2 made and saved there, its logits equal to capstone's before training, trained on 2
ranks, exported with --format hf and loaded back with the same logits. No network."""

import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import ROOT, mpirun
from test_export import hf_logits, torch_python

from capstone import export
from capstone.gpt2 import tensors as gpt2_tensors

from capstone.gpt2 import hf
from capstone.config import ConfigError, ModelConfig
from capstone.data.tokenizer import train_bpe
from capstone.model.gpt import logits
from capstone.model.params import Layout, init_params
from capstone.sample import load_checkpoint

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
        "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow.\n") * 60
GPT2 = {"vocab_size": 300, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, "tie_word_embeddings": True,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def capstone_logits(cfg: ModelConfig, params: np.ndarray, ids: np.ndarray) -> np.ndarray:
    layout = Layout.for_model(cfg, 1)
    flat = layout.zeros()
    flat[:params.size] = params
    return logits(layout.groups(flat), ids, cfg).reshape(*ids.shape, -1)


def write_dir(path, cfg: ModelConfig, params, prefixed: bool = True, **config) -> None:
    """A GPT-2 directory of capstone weights, as save_pretrained (`transformer.` names) or the hub (none)."""
    os.makedirs(path, exist_ok=True)
    tensors = gpt2_tensors.named_tensors(Layout.for_model(cfg, 1).views(params))
    if not prefixed:
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**export.hf_config(cfg), **config}, f)


def write_gpt2_vocab(directory, vocab_size: int) -> None:
    """vocab.json + merges.txt of a BPE trained on TEXT, with GPT-2's <|endoftext|> as its last entry."""
    from capstone.data.tokenizer import library
    spec = json.loads(train_bpe(TEXT, vocab_size - 1).json)
    spec["model"]["vocab"]["<|endoftext|>"] = len(spec["model"]["vocab"])
    library().Tokenizer.from_str(json.dumps(spec)).model.save(str(directory))


def test_gpt2s_special_token_is_one_id_unless_turned_off(tmp_path):
    """Issue 53, item 3: `<|endoftext|>` in a text became 11 byte-level tokens; GPT2Tokenizer gives its one
    id (50256 in GPT-2), and so does capstone now (also a special token a directory's
    special_tokens_map.json names, if its vocabulary holds it); `special=False` keeps the bytes."""
    from capstone.data.tokenizer import from_gpt2_files
    write_gpt2_vocab(tmp_path, 300)
    vocab = json.load(open(tmp_path / "vocab.json"))
    word = max((t for t in vocab if t.isascii() and t.isalpha()), key=len)     # an entry of the vocabulary
    with open(tmp_path / "special_tokens_map.json", "w") as f:
        json.dump({"pad_token": {"content": word, "special": True}, "eos_token": "<|endoftext|>",
                   "unk_token": "<not in the vocabulary>"}, f)
    files = (str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    tok, plain = from_gpt2_files(*files), from_gpt2_files(*files, special=False)
    text = f"a {word}<|endoftext|>The"
    ids = tok.encode(text).tolist()
    assert vocab["<|endoftext|>"] == 299 and 299 in ids and vocab[word] in ids and tok.vocab_size == 300
    assert 299 not in plain.encode(text).tolist() and len(plain.encode("<|endoftext|>")) > 1
    assert tok.decode(ids) == text
    from capstone import prepare
    corpus = tmp_path / "docs.txt"
    corpus.write_text(("<|endoftext|>".join([TEXT[:300]] * 8) + "\n") * 4)
    for flag, holds in (([], True), (["--no-special-tokens"], False)):
        out = tmp_path / f"data{len(flag)}"
        assert prepare.main([str(corpus), "--out", str(out), "--tokenizer-from", str(tmp_path), *flag]) == 0
        assert (299 in np.fromfile(out / "train.bin", dtype="<u2")) == holds, flag


@pytest.mark.parametrize("prefixed", [True, False])
def test_both_key_sets_are_read_and_the_positions_cropped(tmp_path, prefixed):
    cfg = ModelConfig(vocab_size=20, seq_len=12, d_model=16, n_heads=2, n_layers=2, head_bias=False,
                      tie_embeddings=True)
    layout = Layout.for_model(cfg, 1)
    params = init_params(layout, cfg, 5)
    write_dir(tmp_path / "m", cfg, params, prefixed)
    got_cfg, got, data = hf.read(str(tmp_path / "m"))
    assert got_cfg == cfg and np.array_equal(got, params[:layout.n_params]) and data == {}
    short, cropped, _ = hf.read(str(tmp_path / "m"), seq_len=5)
    assert short.seq_len == 5
    want = Layout.for_model(cfg, 1).views(params)
    views = Layout.for_model(short, 1).views(cropped)
    assert np.array_equal(views["wpe"], want["wpe"][:5]) and np.array_equal(views["h1.mlp.c_fc.w"], want["h1.mlp.c_fc.w"])


@pytest.mark.parametrize("change, words", [
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06"),
    ({"n_inner": 100}, "n_inner 100"),
    ({"scale_attn_by_inverse_layer_idx": True}, "attention scaling"),
    ({"model_type": "gpt_neo"}, "model_type is 'gpt_neo'"),
])
def test_what_capstone_cannot_compute_is_refused_with_the_reason(change, words):
    cfg = ModelConfig(vocab_size=20, seq_len=8, d_model=16, n_heads=2, n_layers=1, head_bias=False)
    with pytest.raises(ConfigError, match="cannot represent this GPT-2 model") as exc:
        hf.model_config({**export.hf_config(cfg), **change}, None, "DIR")
    assert words in str(exc.value)
    with pytest.raises(ConfigError, match="--seq-len 9 is longer than its n_positions 8"):
        hf.model_config(export.hf_config(cfg), 9, "DIR")


def test_an_unreadable_directory_is_refused_at_start(tmp_path):
    cfg = ModelConfig(vocab_size=20, seq_len=8, d_model=16, n_heads=2, n_layers=1, head_bias=False)
    write_dir(tmp_path / "m", cfg, init_params(Layout.for_model(cfg, 1), cfg, 1), activation_function="relu")
    res = mpirun(1, "--out", tmp_path / "run", "--init-from", tmp_path / "m", "--steps", 2, "--quiet")
    assert res.returncode == 2 and "activation_function 'relu'" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.count("error:") == 1


def test_gpt2_round_trip_through_transformers(tmp_path):
    python = torch_python()
    model = str(tmp_path / "gpt2")
    os.makedirs(model)
    write_gpt2_vocab(model, GPT2["vocab_size"])    # vocab.json, merges.txt; <|endoftext|> the last id, as GPT-2's
    joined = TEXT[:100] + "<|endoftext|>" + TEXT[100:200]     # documents joined by GPT-2's special token
    made = subprocess.run([python, os.path.join(ROOT, "tests", "gpt2_make.py"), model, json.dumps(GPT2), joined],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    made = json.loads(made.stdout)
    assert made["tied"] and "model.safetensors" in made["files"]
    assert "lm_head.weight" not in load_file(os.path.join(model, "model.safetensors"))   # tied: wte only
    assert hf.gpt2_tokenizer(model).encode(joined).tolist() == made["ids"]                # transformers' ids
    assert GPT2["vocab_size"] - 1 in made["ids"]     # issue 53, item 3: the special token is one id, as there

    cfg, params, data = hf.read(model)                  # before training: the original's logits
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, cfg.seq_len)).astype(np.int32)
    want = capstone_logits(cfg, params, ids)
    r = hf_logits(python, model, ids, want, tmp_path)
    assert r["missing"] == r["unexpected"] == [] and r["max_abs_diff"] < 1e-5 and np.abs(want).max() > 0.1, r

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    prep = subprocess.run([os.sys.executable, "-m", "capstone.prepare", str(text), "--out", str(tmp_path / "data"),
                           "--tokenizer-from", model], capture_output=True, text=True, cwd=ROOT)
    assert prep.returncode == 0, prep.stderr
    res = mpirun(2, "--out", tmp_path / "run", "--init-from", model, "--data", tmp_path / "data", "--seq-len", 16,
                 "--steps", 4, "--ckpt-every", 4, "--lr", 1e-3, "--warmup-steps", 0, "--eval-every", 2, "--zero-stage", 3,
                 "--quiet", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    out = str(tmp_path / "hf")
    assert export.main([str(tmp_path / "run"), "--out", out, "--format", "hf"]) == 0
    loaded = subprocess.run([python, "-c", "import json, os, sys; os.environ['HF_HUB_OFFLINE'] = '1'; "
                             "from transformers import AutoTokenizer; "
                             "print(json.dumps(AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[2])['input_ids']))",
                             out, joined], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr          # issue 53, item 4: the export's own tokenizer files
    assert json.loads(loaded.stdout) == hf.gpt2_tokenizer(model).encode(joined).tolist()
    _, trained_cfg, trained = load_checkpoint(os.path.join(tmp_path, "run", "checkpoints", "ckpt-00000004.h5"))
    assert trained_cfg.seq_len == 16 and trained_cfg.tie_embeddings
    wte = cfg.vocab_size * cfg.d_model
    assert np.abs(trained[:wte] - params[:wte]).max() > 1e-4       # it trained (wte comes first in both layouts)
    ids = ids[:, :16]
    want = capstone_logits(trained_cfg, trained, ids)
    r = hf_logits(python, out, ids, want, tmp_path)
    assert r["missing"] == r["unexpected"] == [] and r["max_abs_diff"] < 1e-5, r

    sample = subprocess.run([os.sys.executable, "-m", "capstone.sample", str(tmp_path / "run"), "--prompt",
                             "The quick", "--tokens", "8"], capture_output=True, text=True, cwd=ROOT)
    assert sample.returncode == 0 and "The quick" in sample.stdout, sample.stdout + sample.stderr     # BPE decoded


def test_the_gpt2_presets_are_gpt2s_shape():
    from capstone import cli
    for name, (L, C, T) in {"gpt2": (12, 768, 1024), "gpt2-mini": (4, 256, 256)}.items():
        m = cli.parse(["--preset", name]).model
        assert (m.n_layers, m.d_model, m.seq_len, m.vocab_size, m.tie_embeddings, m.head_bias) == (L, C, T, 50257,
                                                                                                    True, False)
        V = m.vocab_size     # GPT-2's count: wte, wpe, L blocks of 12 C^2 + 13 C, ln_f
        assert Layout.for_model(m, 1).n_params == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert Layout.for_model(cli.parse(["--preset", "gpt2"]).model, 1).n_params == 124_439_808   # GPT-2 small


@pytest.mark.parametrize("cap_mib", [1536, 3072, 6144])
def test_the_preflight_says_how_many_ranks_fit_a_cap(cap_mib):
    import re
    from capstone import cli
    from capstone.plan import Plan, Zero
    from capstone.runtime import preflight
    s = cli.parse(["--preset", "gpt2", "--no-tie-embeddings", "--pp", "2"])
    plan = Plan.make(model=s.model, train=s.train, world=2, given=s.layout)[0]
    said = preflight.ranks_needed(s.model, s.train, plan, cap_mib << 20)

    def sharded(ranks):
        return plan.on(ranks, zero=Zero(3), recompute=True)
    if "no number of ranks fits" in said:     # a micro-batch's activations or a checkpoint's conversion exceed the cap
        assert preflight.estimate(s.model, s.train, sharded(4096))[0] > cap_mib << 20 and cap_mib < 6144, said
        return
    ranks = int(re.search(r"it needs (\d+) ranks", said).group(1))
    assert sum(preflight.estimate(s.model, s.train, sharded(ranks))) <= cap_mib << 20
    assert ranks == 2 or sum(preflight.estimate(s.model, s.train, sharded(ranks - 2))) > cap_mib << 20   # the fewest


def test_a_gpt2_directory_s_vocabulary_refusals_name_its_tokenizer(tmp_path):
    """A Hugging Face directory's advice is `prepare --tokenizer-from DIR` (it has no dataset for --vocab-from);
    one without a tokenizer says so, and one with half of it names the missing file (was: "trained on the
    synthetic corpus" and --vocab-from <the source run's dataset directory>)."""
    from capstone.gpt2 import finetune
    from capstone.data.tokenizer import library
    cfg = ModelConfig(vocab_size=300, seq_len=8, d_model=16, n_heads=2, n_layers=1, head_bias=False)
    model = str(tmp_path / "m")
    write_dir(model, cfg, init_params(Layout.for_model(cfg, 1), cfg, 1))
    char = {"tokenizer": {"kind": "char", "chars": "ab"}}
    with pytest.raises(ConfigError, match="holds no tokenizer") as exc:
        finetune.check_vocabulary(finetune.read(model), char, "data/x")
    assert f"--tokenizer-from {model}" in str(exc.value) and "synthetic corpus" in str(exc.value)
    library().Tokenizer.from_str(train_bpe(TEXT, 300).json).model.save(model)       # vocab.json, merges.txt
    source = finetune.read(model)
    for data, words in ((char, "the vocabularies differ"), ({}, "this run on the synthetic corpus")):
        with pytest.raises(ConfigError, match=words) as exc:
            finetune.check_vocabulary(source, data, "data/x" if data else None)
        assert f"--tokenizer-from {model}" in str(exc.value) and "--vocab-from" not in str(exc.value)
    os.remove(os.path.join(model, "merges.txt"))
    with pytest.raises(ConfigError, match="vocab.json found but merges.txt missing"):
        finetune.read(model)


def test_tokenizer_from_a_wrong_path_says_what_it_is(tmp_path):
    """No such directory, a file, capstone's export (its tokenizer is in the metadata: --vocab-from); was
    "missing: vocab.json, merges.txt" for each."""
    from capstone.data.tokenizer import TokenizerError
    (tmp_path / "export").mkdir()
    save_file({"w": np.zeros(1, np.float32)}, str(tmp_path / "export" / "model.safetensors"),
              metadata={"format": "pt", "capstone_format": "capstone-gpt2"})
    for path, words in (("nope", "no such directory"), ("export/model.safetensors", "not a directory"),
                        ("export", "--vocab-from <the dataset the run trained on>")):
        with pytest.raises(TokenizerError, match=words):
            hf.gpt2_tokenizer(str(tmp_path / path))
