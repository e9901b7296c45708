import hashlib
import importlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prepare_data
from dataset import TokenWindows, get_tokenizer, load_meta, read_shard
from hub_server import CurrentStderr, Hub
from prepare_data import prepare

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the loop runs a block again and its residual stream grows unless alpha keeps it in check".split()


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"Doc {i}: " + " ".join(rng.choice(WORDS, size=rng.integers(5, 60))) + (" é✓" if i % 3 else "")
            for i in range(n)]


def parquet_bytes(texts, pad=0):
    """A parquet file of the texts; pad: that many random bytes in a column the reader skips, for a file larger
    than the client's 10 MB download chunk."""
    columns = {"id": list(range(len(texts))), "text": texts}
    if pad:
        columns["pad"] = [os.urandom(pad)] + [b""] * (len(texts) - 1)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink, row_group_size=7)
    return sink.getvalue().to_pybytes()


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
    (src / "c.parquet").write_bytes(parquet_bytes(docs[20:30] + [None] + docs[30:]))
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


def expect_error(capsys, fn, *words, alone=False):
    """fn stops with exit code 2 and an "error: " line holding every word; alone: the only line on stderr."""
    with pytest.raises(SystemExit) as e:
        fn()
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 or not alone, lines
    err = lines[-1]
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
    assert val == [e for i, e in enumerate(encoded) if prepare_data.split_of(i, 7, 0.3, None) == "val"]
    assert train == [e for i, e in enumerate(encoded) if prepare_data.split_of(i, 7, 0.3, None) == "train"]
    # deterministic: the same again, whatever the shard size; another seed splits differently
    again = prepare(sources, out_dir=str(tmp_path / "e"), val_fraction=0.3, seed=7, shard_size=50, quiet=True)
    assert split_documents(again, "train", 50256) == train and len(load_meta(again)["shards"]["train"]) > 3
    other = prepare(sources, out_dir=str(tmp_path / "f"), val_fraction=0.3, seed=8, quiet=True)
    assert split_documents(other, "val", 50256) != val


def test_test_share_holds_out_part_of_val_and_leaves_train_alone(tmp_path, corpus, capsys):
    sources, docs = corpus
    plain = prepare(sources, out_dir=str(tmp_path / "plain"), val_fraction=0.5, seed=7, quiet=True)
    held = prepare(sources, out_dir=str(tmp_path / "held"), val_fraction=0.5, seed=7, test_share=0.5, shard_size=40,
                   quiet=True)
    meta = load_meta(held)
    train, val, test = (split_documents(held, s, 50256) for s in ("train", "val", "test"))
    assert train == split_documents(plain, "train", 50256)  # the same training text, document for document
    assert len(val) > 0 and len(test) > 0 and meta["test_share"] == 0.5 and "test_share" not in load_meta(plain)
    assert not set(test) & set(val) and not set(test) & set(train)  # the 40 documents are distinct
    assert sorted(val + test) == sorted(split_documents(plain, "val", 50256))
    # each split's hash is that of its tokens, whatever the shard size: the same train hash as the plain folder's
    for split in ("train", "val", "test"):
        tokens = b"".join(read_shard(os.path.join(held, s["file"])).tobytes() for s in meta["shards"][split])
        assert meta["split_sha256"][split] == hashlib.sha256(tokens).hexdigest()
    assert meta["split_sha256"]["train"] == load_meta(plain)["split_sha256"]["train"]
    assert load_meta(plain)["tokens"]["test"] == 0 and TokenWindows(held, "test", 4).tokens == meta["tokens"]["test"]
    # a test share is a share of val, so it needs one
    with pytest.raises(SystemExit):
        prepare(sources, out_dir=str(tmp_path / "none"), val_fraction=0.0, test_share=0.5, quiet=True)
    assert "test_share is the share of val's documents" in capsys.readouterr().err


def test_test_share_is_part_of_what_makes_a_folder_the_same_corpus(tmp_path, corpus, capsys, monkeypatch):
    """A folder made with --test_share counts as already prepared only for a request with the same share, and one made
    without it only for a request without it (the val split would silently be another); an unfinished folder's error
    names the setting that differs."""
    sources, _ = corpus
    kw = dict(val_fraction=0.5, seed=7, shard_size=40, quiet=True)
    held = prepare(sources, out_dir=str(tmp_path / "held"), test_share=0.3, **kw)
    plain = prepare(sources, out_dir=str(tmp_path / "plain"), **kw)
    assert prepare(sources, out_dir=held, test_share=0.3, **kw) == held
    for out, asked, there in ((held, {}, "test_share=0.3 there, None asked"),
                              (plain, dict(test_share=0.3), "test_share=None there, 0.3 asked"),
                              (held, dict(test_share=0.5), "test_share=0.3 there, 0.5 asked")):
        err = expect_error(capsys, lambda: prepare(sources, out_dir=out, **asked, **kw), alone=True)
        assert err == f"error: {out} already holds a dataset prepared with other settings ({there}): prepare with its " \
                      f"settings, delete it, or choose another folder with --name or --out"

    kill_at_shard(monkeypatch, "train_000001.bin")  # a kill once the first chunk is written: an unfinished folder
    unfinished = str(tmp_path / "unfinished")
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, out_dir=unfinished, test_share=0.3, **kw)
    monkeypatch.undo()
    err = expect_error(capsys, lambda: prepare(sources, out_dir=unfinished, **kw), alone=True)
    assert err == f"error: {unfinished} holds an unfinished run with other settings (test_share=0.3 there, None " \
                  f"asked): rerun it with the same settings to finish it, or delete the folder"
    assert prepare(sources, out_dir=unfinished, test_share=0.3, **kw) == unfinished  # which finishes it
    assert load_meta(unfinished)["split_sha256"] == load_meta(held)["split_sha256"]


def kill_at_shard(monkeypatch, name, written=None):
    """prepare_data.write_shard raising KeyboardInterrupt (a kill) at the shard file named name, having written none
    of it, "half" (a .tmp holding part of it) or the "whole" shard."""
    real_write = prepare_data.write_shard

    def write(path, pieces):
        if path.endswith(name):
            if written == "half":
                open(path + ".tmp", "wb").write(b"half")
            elif written == "whole":
                real_write(path, pieces)
            raise KeyboardInterrupt
        return real_write(path, pieces)
    monkeypatch.setattr(prepare_data, "write_shard", write)


def test_bytes_prepare_round_trip(tmp_path, corpus):
    sources, docs = corpus
    out = prepare(sources[1:2], tokenizer="bytes", out_dir=str(tmp_path / "b"), val_fraction=0.0, quiet=True)
    meta = load_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_token"]) == ("bytes", 257, 256)
    train = split_documents(out, "train", 256)
    assert [bytes(d).decode("utf-8") for d in train] == docs[4:20]
    assert meta["tokens"] == {"train": sum(len(d.encode()) + 1 for d in docs[4:20]), "val": 0, "test": 0}
    # a lone surrogate, valid in JSON but with no UTF-8 form, becomes U+FFFD, as with the gpt2 tokenizer
    (tmp_path / "lone.jsonl").write_text('{"text": "a\\ud800b"}\n')
    out = prepare([str(tmp_path / "lone.jsonl")], tokenizer="bytes", out_dir=str(tmp_path / "lone"), val_fraction=0.0,
                  quiet=True)
    assert split_documents(out, "train", 256) == [tuple("a\ufffdb".encode())]
    assert sorted(os.listdir(out)) == ["meta.json", "train_000000.bin"]  # finished: no progress.json left


@pytest.mark.parametrize("crash", ["while writing", "after renaming"])
def test_resume_after_interruption(tmp_path, corpus, monkeypatch, crash):
    sources, docs = corpus
    kw = dict(val_fraction=0.3, seed=3, shard_size=120, quiet=True)
    reference = prepare(sources, out_dir=str(tmp_path / "ref"), **kw)
    assert len(load_meta(reference)["shards"]["train"]) >= 4

    # a kill in the middle of a write leaves part of it; one after a shard got its name, before progress.json says so
    kill_at_shard(monkeypatch, "train_000002.bin", written="half" if crash == "while writing" else "whole")
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

    monkeypatch.undo()  # write_shard as it is
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
# the hub: huggingface_hub itself, unpatched, against a local server of the hub's API (tests/hub_server.py)

FINEWEB, OWT, OWT_REVISION = "HuggingFaceFW/fineweb-edu", "Skylion007/openwebtext", "refs/convert/parquet"


def publish(hub, tmp_path, repo_id, files, revision="main"):
    """A commit of files ({name: texts or bytes}) in repo_id at revision on the hub, and the same bytes as local
    files -> (the commit, {name: local path})."""
    files = {name: data if isinstance(data, bytes) else parquet_bytes(data) for name, data in files.items()}
    local = {}
    for name, data in files.items():
        local[name] = tmp_path / "local" / repo_id / name
        local[name].parent.mkdir(parents=True, exist_ok=True)
        local[name].write_bytes(data)
    return hub.add(repo_id, files, revision), {name: str(path) for name, path in sorted(local.items())}


@pytest.fixture
def hub(tmp_path):
    """A hub of the test's own that the real huggingface_hub talks to: HF_ENDPOINT points at it, HF_HUB_CACHE and
    HF_HOME (the token file) into tmp_path, no token, no Xet, short timeouts. The runs are in this process: a
    subprocess costs ~1.8 s (importing huggingface_hub, loading the tokenizer), and huggingface_hub reads these
    variables once, into huggingface_hub.constants when it is imported, and from there at every call, so reloading
    that module after setting them gives what a new process sees (test_hub_cli checks it in one)."""
    import huggingface_hub.constants
    import huggingface_hub.utils.logging
    for handler in huggingface_hub.utils.logging.get_logger().handlers:  # it keeps the sys.stderr of its import,
        handler.setStream(CurrentStderr())  # which pytest closes after that test: to each test's own instead
    server = Hub()
    with pytest.MonkeyPatch.context() as mp:
        for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            mp.delenv(key, raising=False)
        for key, value in dict(HF_ENDPOINT=server.url, HF_HUB_CACHE=str(tmp_path / "hf_cache"),
                               HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1",
                               HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="5", HF_HUB_DOWNLOAD_TIMEOUT="5").items():
            mp.setenv(key, value)
        importlib.reload(huggingface_hub.constants)
        try:
            yield server
        finally:
            server.close()
    importlib.reload(huggingface_hub.constants)
    assert not server.errors, server.errors


def test_fineweb_edu_from_the_hub_is_its_files(tmp_path, hub):
    """Listing (in pages), download, tokenize, delete: the shards are exactly those that the same parquet files give
    as local sources, only the subset's files are read, every request after the first names the commit that the
    revision pointed to, a downloaded file is deleted after use, and --max_tokens downloads no further file."""
    docs = documents(30, seed=1)
    subset = {f"sample/10BT/{k:03d}_00000.parquet": docs[10 * k:10 * k + 10] for k in range(3)}
    commit, local = publish(hub, tmp_path, FINEWEB, {**subset, "sample/100BT/000_00000.parquet": ["another subset"],
                                                     "data/CC-MAIN-2024-10/000_00000.parquet": ["a dump"],
                                                     "README.md": b"# FineWeb-Edu"})
    kw = dict(val_fraction=0.2, shard_size=100, quiet=True)
    out = prepare("fineweb_edu", out_dir=str(tmp_path / "fw"), **kw)
    reference = prepare([local[name] for name in subset], out_dir=str(tmp_path / "loc"), **kw)
    meta = load_meta(out)
    assert (meta["source"], meta["subset"]) == ("fineweb_edu", "sample-10BT")
    assert shard_bytes(out) == shard_bytes(reference)
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference))  # nothing else left in the folder
    asked = [path for _, path, _ in hub.requests if path.startswith(("/api/datasets/", "/datasets/"))]
    assert asked[0] == f"/api/datasets/{FINEWEB}/revision/main"
    assert all(path.endswith(f"/{commit}") or f"/{commit}/" in path for path in asked[1:])
    assert hub.count("GET", f"/api/datasets/{FINEWEB}/tree/{commit}") == 4  # 11 entries in pages of 3
    assert hub.count("HEAD", f"/datasets/{FINEWEB}/resolve/{commit}/sample/10BT/") == hub.count("GET", "/cdn/") == 3
    repo_cache = tmp_path / "hf_cache" / "datasets--HuggingFaceFW--fineweb-edu"
    assert not [f for f in repo_cache.rglob("*") if not f.is_dir()]  # each download deleted after use
    few = prepare("fineweb_edu", out_dir=str(tmp_path / "few"), max_documents=12, quiet=True)
    assert sum(load_meta(few)["documents"].values()) == 12
    hub.requests.clear()
    capped = prepare("fineweb_edu", out_dir=str(tmp_path / "cap"), max_tokens=200, quiet=True)
    enc = get_tokenizer("gpt2")
    lengths = np.cumsum([len(enc.encode_ordinary(d)) + 1 for d in docs])
    last = np.searchsorted(lengths, 200)  # the document at which the cut stops
    assert sum(load_meta(capped)["tokens"].values()) == lengths[last]
    assert last < 10 and hub.count("GET", "/cdn/") == 1  # stopped in the first file: the others never downloaded
    assert not [f for f in repo_cache.rglob("*") if not f.is_dir()]  # also the file the cut stopped in
    other = prepare("fineweb_edu", subset="sample-100BT", out_dir=str(tmp_path / "100BT"), val_fraction=0.0,
                    quiet=True)
    assert split_documents(other, "train", 50256) == [tuple(enc.encode_ordinary("another subset"))]


def test_openwebtext_from_the_hub_reuses_the_cache(tmp_path, hub, capsys):
    """Files already in the user's cache (put there by hf_hub_download, as `hf download` does) are read from there
    and kept: runs list the files and download none. When the parquet conversion is partial, that part is prepared
    with a warning. A finished folder asks the hub nothing."""
    from huggingface_hub import hf_hub_download
    docs = documents(20, seed=2)
    commit, local = publish(hub, tmp_path, OWT, {f"plain_text/partial-train/{k:04d}.parquet": docs[10 * k:10 * k + 10]
                                                 for k in range(2)}, revision=OWT_REVISION)
    for name in local:
        hf_hub_download(OWT, name, repo_type="dataset", revision=OWT_REVISION)
    assert hub.count("GET", "/cdn/") == 2
    hub.requests.clear()
    kw = dict(val_fraction=0.2, shard_size=100, quiet=True)
    out = prepare("openwebtext", out_dir=str(tmp_path / "owt"), **kw)
    assert "only plain_text/partial-train/ exists" in capsys.readouterr().err
    again = prepare("openwebtext", out_dir=str(tmp_path / "again"), **kw)
    assert hub.count("GET", f"/api/datasets/{OWT}/revision/refs%2Fconvert%2Fparquet") == 2
    assert hub.count("HEAD", "/datasets/") == hub.count("GET", "/cdn/") == 0  # two runs, nothing downloaded
    reference = prepare(list(local.values()), out_dir=str(tmp_path / "loc"), **kw)
    assert load_meta(out)["source"] == "openwebtext" and shard_bytes(out) == shard_bytes(reference)
    assert shard_bytes(again) == shard_bytes(reference)
    snapshot = tmp_path / "hf_cache" / "datasets--Skylion007--openwebtext" / "snapshots" / commit
    assert sorted(f.name for f in snapshot.rglob("*.parquet") if f.resolve().is_file()) == ["0000.parquet",
                                                                                           "0001.parquet"]
    asked = len(hub.requests)
    prepare("openwebtext", out_dir=out, **kw)
    assert len(hub.requests) == asked  # already prepared: no request


def test_hub_resume_reads_the_same_commit(tmp_path, hub, monkeypatch, capsys):
    docs = documents(30, seed=4)
    publish(hub, tmp_path, FINEWEB, {f"sample/10BT/{k:03d}_00000.parquet": docs[10 * k:10 * k + 10] for k in range(3)})
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
    publish(hub, tmp_path / "new", FINEWEB, {"sample/10BT/000_00000.parquet": ["a new commit"]})  # the dataset moved on
    expect_error(capsys, lambda: prepare("fineweb_edu", out_dir=str(tmp_path / "moved"), **kw),
                 "the source files changed since the unfinished run", "delete the folder and start again")


def finished_shards(out_dir):
    """{file: (inode, mtime)} of the shards that progress.json lists, and where the next chunk starts."""
    progress = json.load(open(os.path.join(out_dir, "progress.json")))
    files = [s["file"] for split in ("train", "val") for s in progress["shards"][split]]
    assert sorted(files) == sorted(f for f in os.listdir(out_dir) if f.endswith(".bin"))  # no other shard
    return {f: (os.stat(os.path.join(out_dir, f)).st_ino, os.stat(os.path.join(out_dir, f)).st_mtime_ns)
            for f in files}, progress["next"]


def test_hub_download_cut_off(tmp_path, hub, capsys, monkeypatch):
    """A connection dropped in the middle of a file: the client resumes it with a Range request. When the hub answers
    503 after the drop, the run ends in one line and keeps its finished shards; the rerun fetches that file again from
    its start (the client keeps no partial file), and the shards hold every document exactly once."""
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 200)  # batches much smaller than a file, as with the hub's files
    docs = documents(30, seed=5)
    big = parquet_bytes(docs[10:20], pad=11 << 20)  # over the 10 MB the client reads at a time: a part gets to disk
    files = {"sample/10BT/000_00000.parquet": docs[:10], "sample/10BT/001_00000.parquet": big,
             "sample/10BT/002_00000.parquet": docs[20:]}
    _, local = publish(hub, tmp_path, FINEWEB, files)
    kw = dict(val_fraction=0.2, shard_size=60, quiet=True)
    reference = shard_bytes(prepare(list(local.values()), out_dir=str(tmp_path / "ref"), **kw))
    big_url = f"/cdn/{hashlib.sha256(big).hexdigest()}"

    hub.cut(big, after=len(big) - 1000)
    assert shard_bytes(prepare("fineweb_edu", out_dir=str(tmp_path / "once"), **kw)) == reference
    ranges = [headers.get("range") for _, path, headers in hub.requests if path == big_url]
    assert len(ranges) == 2 and ranges[0] is None and 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) < len(big)
    assert "Trying to resume download" in capsys.readouterr().err  # the client's own line

    hub.requests.clear()
    hub.cut(big, after=len(big) - 1000, then_status=503)
    run = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        prepare("fineweb_edu", out_dir=run, **kw)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and not any("Traceback" in line for line in err)
    assert err[-1].startswith("error: download of sample/10BT/001_00000.parquet from HuggingFaceFW/fineweb-edu failed "
                              "(HTTP 503 ") and err[-1].endswith("rerun the same command later; the finished shards "
                                                                 "are kept"), err
    assert sum(line.startswith("error: ") for line in err) == 1
    kept, start = finished_shards(run)
    assert kept and start[0] == 0  # shards of the first file, nothing of the cut one
    assert not list((tmp_path / "hf_cache").rglob("*.incomplete"))  # the client deleted its partial download
    hub.status = None
    hub.requests.clear()
    assert shard_bytes(prepare("fineweb_edu", out_dir=run, **kw)) == reference  # every document once
    assert [headers.get("range") for _, path, headers in hub.requests if path == big_url] == [None]
    assert {f: (os.stat(os.path.join(run, f)).st_ino, os.stat(os.path.join(run, f)).st_mtime_ns) for f in kept} == kept


def test_hub_file_that_is_not_parquet(tmp_path, hub, capsys, monkeypatch):
    """A hub file whose bytes are no parquet file (a proxy's error page, say): one line naming it, nothing of it in a
    shard, the earlier shards kept, the download deleted; the rerun fetches it again and stops at it again."""
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 200)  # batches much smaller than a file, as with the hub's files
    docs = documents(20, seed=6)
    commit, _ = publish(hub, tmp_path, FINEWEB, {"sample/10BT/000_00000.parquet": docs[:10],
                                                 "sample/10BT/001_00000.parquet": b"<html>Too many requests</html>",
                                                 "sample/10BT/002_00000.parquet": docs[10:]})
    run = str(tmp_path / "run")
    kept = None
    for attempt in range(2):
        expect_error(capsys, lambda: prepare("fineweb_edu", out_dir=run, val_fraction=0.2, shard_size=60, quiet=True),
                     f"hf://datasets/{FINEWEB}@{commit}/sample/10BT/001_00000.parquet is not a readable parquet file",
                     "the download is deleted; rerun to fetch it again", alone=True)
        shards, start = finished_shards(run)
        assert shards and start[0] == 0 and shards == (kept or shards)
        kept = shards
        assert not [f for f in (tmp_path / "hf_cache" / "datasets--HuggingFaceFW--fineweb-edu").rglob("*")
                    if not f.is_dir()]  # the download deleted
    assert hub.count("GET", "/cdn/") == 4  # both runs: the first file (to redo its unfinished chunk), the bad one


@pytest.mark.parametrize("case", ["gated", "no repo", "no revision", "hub down", "refused"])
def test_hub_errors_are_one_line_naming_the_fix(tmp_path, hub, capsys, monkeypatch, case):
    """Each within seconds (huggingface_hub's retries of a listing take ~25 s: the first request has none), with
    nothing written but the gated run's progress.json; with HF_TOKEN the gated dataset is read, the token sent to the
    hub as a bearer token (not to the file host), and printed nowhere."""
    docs = documents(10, seed=7)
    if case != "no repo":
        publish(hub, tmp_path, OWT, {"plain_text/train/0000.parquet": docs},
                revision="main" if case == "no revision" else OWT_REVISION)
    hub.token = "hf_gatedsecret" if case == "gated" else None
    hub.status = 500 if case == "hub down" else None
    if case == "refused":
        hub.close()
    words = {"gated": ["download of plain_text/train/0000.parquet from Skylion007/openwebtext failed (HTTP 401 Access "
                       "to dataset Skylion007/openwebtext is restricted", "set HF_TOKEN to a token of an account that "
                       "may read Skylion007/openwebtext"],
             "no repo": [f"cannot list {OWT}@{OWT_REVISION}'s files at {hub.url} (HTTP 404 Repository not found: "
                         f"{OWT}): check HF_ENDPOINT (now {hub.url})"],
             "no revision": [f"(HTTP 404 Invalid rev id: {OWT_REVISION}): check HF_ENDPOINT"],
             "hub down": ["(HTTP 500 the hub is down): the hub is not answering; rerun the same command later"],
             "refused": [f"cannot list {OWT}@{OWT_REVISION}'s files at {hub.url} (", "check the network and "
                         f"HF_ENDPOINT (now {hub.url}), then rerun"]}[case]
    out = tmp_path / "owt"
    t0 = time.monotonic()
    expect_error(capsys, lambda: prepare("openwebtext", out_dir=str(out), quiet=True), *words, alone=True)
    assert time.monotonic() - t0 < 10
    if case == "hub down":
        assert hub.count("GET", f"/api/datasets/{OWT}/") == 1  # asked once, not retried
    if case == "gated":
        assert os.listdir(out) == ["progress.json"]  # the listing passed; stopped at the first download
    else:
        assert not out.exists()
    if case == "gated":
        monkeypatch.setenv("HF_TOKEN", hub.token)
        hub.requests.clear()
        out = prepare("openwebtext", out_dir=str(out), quiet=True)
        assert sum(load_meta(out)["documents"].values()) == len(docs)
        sent = {(path.split("/")[1], headers.get("authorization")) for _, path, headers in hub.requests
                if not path.startswith("/api/agent-harnesses")}
        assert sent == {("api", "Bearer hf_gatedsecret"), ("datasets", "Bearer hf_gatedsecret"), ("cdn", None)}
        assert hub.token not in "".join(capsys.readouterr())


def test_hub_cli(tmp_path, hub):
    """The command in a process of its own, where huggingface_hub reads HF_ENDPOINT and HF_HUB_CACHE at its import:
    a gated dataset read with HF_TOKEN, which the output never shows."""
    docs = documents(20, seed=8)
    _, local = publish(hub, tmp_path, FINEWEB, {f"sample/10BT/{k:03d}_00000.parquet": docs[10 * k:10 * k + 10]
                                                for k in range(2)})
    hub.token = "hf_clisecret"
    r = subprocess.run([sys.executable, os.path.join(REPO, "prepare_data.py"), "fineweb_edu", "--out=d",
                        "--val_fraction=0.2", "--shard_size=100"], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, HF_TOKEN=hub.token))  # the fixture's HF_ENDPOINT, HF_HUB_CACHE, ...
    assert r.returncode == 0, r.stderr
    assert hub.token not in r.stdout + r.stderr and "d train: " in r.stdout
    assert hub.count("HEAD", f"/datasets/{FINEWEB}/resolve/") == hub.count("GET", "/cdn/") == 2
    assert {headers.get("authorization") for _, path, headers in hub.requests
            if path.startswith("/datasets/")} == {"Bearer hf_clisecret"}
    reference = prepare(list(local.values()), out_dir=str(tmp_path / "loc"), val_fraction=0.2, shard_size=100,
                        quiet=True)
    assert shard_bytes(str(tmp_path / "d")) == shard_bytes(reference)


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
                                              "(a source is builtin, stdlib, openwebtext, fineweb_edu, or "
                                              ".txt/.jsonl/.parquet files and globs)"]
    r = run(*sources, "--name=mydata", "--tokenizer=bytes", "--val_fraction=0.25", "--shard_size=500")
    assert r.returncode == 0, r.stderr
    meta = load_meta(str(tmp_path / "data" / "mydata"))
    assert (meta["tokenizer"], meta["val_fraction"], meta["shard_size"]) == ("bytes", 0.25, 500)
