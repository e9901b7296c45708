import json
import os
import shutil
import subprocess
import sys
import time
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepare_data
from dataset import get_tokenizer, load_meta, read_shard
from prepare_data import prepare

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
    # a lone surrogate, valid in JSON but with no UTF-8 form, becomes U+FFFD, as with the gpt2 tokenizer
    (tmp_path / "lone.jsonl").write_text('{"text": "a\\ud800b"}\n')
    out = prepare([str(tmp_path / "lone.jsonl")], tokenizer="bytes", out_dir=str(tmp_path / "lone"), val_fraction=0.0,
                  quiet=True)
    assert split_documents(out, "train", 256) == [tuple("a\ufffdb".encode())]
    assert sorted(os.listdir(out)) == ["meta.json", "train_000000.bin"]  # finished: no progress.json left


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The hub without a network, through huggingface_hub itself: HfApi (faked) lists the files of a repository
    folder in a local cache, and the real hf_hub_download finds them there (HF_HUB_OFFLINE, HF_HUB_CACHE). Returns
    put(repo_id, {filename: texts}, cached): cached=False leaves the file outside the cache until hf_hub_download is
    called, as a download would."""
    import huggingface_hub
    from huggingface_hub import constants
    cache, remote = tmp_path / "hf_cache", tmp_path / "remote"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def snapshot(repo_id):
        return cache / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT

    class Api:
        endpoint, sha = "local", COMMIT

        def dataset_info(self, repo_id, revision=None, timeout=None):
            return types.SimpleNamespace(sha=self.sha)

        def list_repo_files(self, repo_id, repo_type=None, revision=None):
            assert revision == self.sha  # every file from the one commit that dataset_info named
            return [str(f.relative_to(remote / repo_id)) for f in (remote / repo_id).rglob("*.parquet")]

    real_download = huggingface_hub.hf_hub_download

    def fetch(repo_id, filename):  # as huggingface_hub stores a file: a blob, and a link to it in the snapshot
        blob = snapshot(repo_id).parent.parent / "blobs" / filename.replace("/", "_")
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(remote / repo_id / filename, blob)
        (snapshot(repo_id) / filename).parent.mkdir(parents=True, exist_ok=True)
        (snapshot(repo_id) / filename).symlink_to(blob)

    def download(repo_id, filename, **kwargs):
        if not (snapshot(repo_id) / filename).exists():
            fetch(repo_id, filename)
        return real_download(repo_id, filename, **kwargs)
    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)

    def put(repo_id, files, cached):
        paths = []
        for filename, texts in files.items():
            paths.append(remote / repo_id / filename)
            paths[-1].parent.mkdir(parents=True, exist_ok=True)
            write_parquet(paths[-1], texts)
            if cached:
                fetch(repo_id, filename)
        return paths, snapshot(repo_id)
    return put


def test_fineweb_edu_from_the_hub_is_its_files(tmp_path, hub):
    """Listing, download, tokenize, delete through huggingface_hub: the shards are exactly those that the same parquet
    files give as local sources, only the subset's files are read, and a downloaded file is deleted after use."""
    docs = documents(30, seed=1)
    files = {f"sample/10BT/{k:03d}_00000.parquet": docs[10 * k:10 * k + 10] for k in range(3)}
    paths, snapshot = hub("HuggingFaceFW/fineweb-edu", files, cached=False)
    hub("HuggingFaceFW/fineweb-edu", {"sample/100BT/000_00000.parquet": ["another subset"],
                                      "data/CC-MAIN-2024-10/000_00000.parquet": ["a dump"]}, cached=False)
    kw = dict(val_fraction=0.2, shard_size=100, quiet=True)
    out = prepare("fineweb_edu", out_dir=str(tmp_path / "fw"), **kw)
    local = prepare([str(f) for f in paths], out_dir=str(tmp_path / "loc"), **kw)
    meta = load_meta(out)
    assert (meta["source"], meta["subset"]) == ("fineweb_edu", "sample-10BT")
    assert shard_bytes(out) == shard_bytes(local)
    assert sorted(os.listdir(out)) == sorted(os.listdir(local))  # nothing else left in the folder
    assert not list(snapshot.rglob("*.parquet")) and not os.listdir(snapshot.parent.parent / "blobs")  # deleted
    few = prepare("fineweb_edu", out_dir=str(tmp_path / "few"), max_documents=12, quiet=True)
    assert sum(load_meta(few)["documents"].values()) == 12
    capped = prepare("fineweb_edu", out_dir=str(tmp_path / "cap"), max_tokens=200, quiet=True)
    enc = get_tokenizer("gpt2")
    lengths = np.cumsum([len(enc.encode_ordinary(d)) + 1 for d in docs])
    assert sum(load_meta(capped)["tokens"].values()) == lengths[np.searchsorted(lengths, 200)]
    assert not list(snapshot.rglob("*.parquet"))  # also the file the cut stopped in
    other = prepare("fineweb_edu", subset="sample-100BT", out_dir=str(tmp_path / "100BT"), val_fraction=0.0,
                    quiet=True)
    assert split_documents(other, "train", 50256) == [tuple(enc.encode_ordinary("another subset"))]


def test_openwebtext_from_the_hub_keeps_cached_files(tmp_path, hub, capsys):
    """A file already in the user's cache is read from there and left in place; when the parquet conversion is
    partial, that part is prepared with a warning."""
    docs = documents(20, seed=2)
    files = {f"plain_text/partial-train/{k:04d}.parquet": docs[10 * k:10 * k + 10] for k in range(2)}
    paths, snapshot = hub("Skylion007/openwebtext", files, cached=True)
    out = prepare("openwebtext", out_dir=str(tmp_path / "owt"), val_fraction=0.2, shard_size=100, quiet=True)
    assert "only plain_text/partial-train/ exists" in capsys.readouterr().err
    local = prepare([str(f) for f in paths], out_dir=str(tmp_path / "loc"), val_fraction=0.2, shard_size=100,
                    quiet=True)
    assert load_meta(out)["source"] == "openwebtext" and shard_bytes(out) == shard_bytes(local)
    assert [f.name for f in sorted(snapshot.rglob("*.parquet")) if f.resolve().is_file()] == ["0000.parquet",
                                                                                               "0001.parquet"]


def test_hub_resume_reads_the_same_commit(tmp_path, hub, monkeypatch, capsys):
    docs = documents(30, seed=4)
    hub("HuggingFaceFW/fineweb-edu", {f"sample/10BT/{k:03d}_00000.parquet": docs[10 * k:10 * k + 10]
                                      for k in range(3)}, cached=False)
    kw = dict(val_fraction=0.2, shard_size=60, quiet=True)
    reference = prepare("fineweb_edu", out_dir=str(tmp_path / "ref"), **kw)

    def write(path, pieces):  # killed in the middle of the corpus
        if path.endswith("train_000006.bin"):
            raise KeyboardInterrupt
        real_write(path, pieces)
    real_write = prepare_data.write_shard
    for name in ("run", "moved"):
        monkeypatch.setattr(prepare_data, "write_shard", write)
        with pytest.raises(KeyboardInterrupt):
            prepare("fineweb_edu", out_dir=str(tmp_path / name), **kw)
    monkeypatch.setattr(prepare_data, "write_shard", real_write)
    assert len(json.load(open(tmp_path / "run" / "progress.json"))["shards"]["train"]) == 6  # kept on resuming
    out = prepare("fineweb_edu", out_dir=str(tmp_path / "run"), **kw)
    assert shard_bytes(out) == shard_bytes(reference) and load_meta(out) == load_meta(reference)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.HfApi, "sha", "f" * 40)  # the dataset got a new commit meanwhile
    expect_error(capsys, lambda: prepare("fineweb_edu", out_dir=str(tmp_path / "moved"), **kw),
                 "the source files changed since the unfinished run", "delete the folder and start again")


def test_hub_offline_fails_fast_in_one_line(tmp_path):
    for args in (["fineweb_edu"], ["openwebtext", "--max_tokens=1000"]):
        t0 = time.time()
        r = subprocess.run([sys.executable, os.path.join(REPO, "prepare_data.py"), *args, "--out=d"], cwd=tmp_path,
                           capture_output=True, text=True, env=dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9"))
        assert r.returncode == 2 and time.time() - t0 < 15
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot list ") and "127.0.0.1:9" in lines[0], lines
        assert "check the network" in lines[0] and not (tmp_path / "d").exists()


@pytest.mark.parametrize("crash", ["while writing", "after renaming"])
def test_resume_after_interruption(tmp_path, corpus, monkeypatch, crash):
    sources, docs = corpus
    kw = dict(val_fraction=0.3, seed=3, shard_size=120, quiet=True)
    reference = prepare(sources, out_dir=str(tmp_path / "ref"), **kw)
    assert len(load_meta(reference)["shards"]["train"]) >= 4

    def write(path, pieces):
        if path.endswith("train_000002.bin"):
            if crash == "while writing":  # a kill in the middle of a write leaves part of it
                open(path + ".tmp", "wb").write(b"half")
            else:  # a kill after a shard got its name, before progress.json says so
                real_write(path, pieces)
            raise KeyboardInterrupt
        return real_write(path, pieces)
    real_write = prepare_data.write_shard
    monkeypatch.setattr(prepare_data, "write_shard", write)
    out = str(tmp_path / "run")
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, out_dir=out, **kw)
    assert os.path.exists(os.path.join(out, "progress.json")) and not os.path.exists(os.path.join(out, "meta.json"))
    with pytest.raises(FileNotFoundError, match="only partly prepared"):
        load_meta(out)  # a half-prepared folder is not a dataset
    progress = json.load(open(os.path.join(out, "progress.json")))
    finished = [s["file"] for split in ("train", "val") for s in progress["shards"][split]]
    assert "train_000001.bin" in finished and "train_000002.bin" not in finished
    left = "train_000002.bin.tmp" if crash == "while writing" else "train_000002.bin"
    assert os.path.exists(os.path.join(out, left))
    done = {f: os.stat(os.path.join(out, f)) for f in finished}
    open(os.path.join(out, "progress.json.tmp"), "w").write('{"half')  # as a kill in write_json would leave

    monkeypatch.setattr(prepare_data, "write_shard", real_write)
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
    assert 0 < len(encoded) < len(docs) and encoded == docs[-len(encoded):]  # carried on from the last chunk
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
    expect_error(capsys, lambda: prepare("fineweb_edu", subset="sample-1T"), "unknown fineweb_edu subset 'sample-1T'",
                 "sample-10BT, sample-100BT, sample-350BT")
    expect_error(capsys, lambda: prepare("openwebtext", subset="sample-10BT"), "--subset is for fineweb_edu only")


def test_cli(tmp_path, corpus):
    sources, _ = corpus
    run = lambda *args: subprocess.run([sys.executable, os.path.join(REPO, "prepare_data.py"), *args],
                                       capture_output=True, text=True, cwd=tmp_path)
    r = run(str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"error: source file not found: {tmp_path / 'missing.txt'} "
                                              "(a source is builtin, openwebtext, fineweb_edu, or "
                                              ".txt/.jsonl/.parquet files and globs)"]
    r = run(*sources, "--name=mydata", "--tokenizer=bytes", "--val_fraction=0.25", "--shard_size=500")
    assert r.returncode == 0, r.stderr
    meta = load_meta(str(tmp_path / "data" / "mydata"))
    assert (meta["tokenizer"], meta["val_fraction"], meta["shard_size"]) == ("bytes", 0.25, 500)
