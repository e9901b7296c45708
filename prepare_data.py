"""
Turn a text corpus into a dataset folder of flat token shards for train.py (dataset.py reads it).

    python prepare_data.py builtin                       # -> data/builtin        (GPT-2 tokens, offline, ~0.7M tokens)
    python prepare_data.py builtin --tokenizer=bytes     # -> data/builtin_bytes  (UTF-8 bytes, offline)
    python prepare_data.py stdlib --tokenizer=bytes      # -> data/stdlib_bytes   (~31M bytes of Python, offline)
    python prepare_data.py stdlib --tokenizer=bytes --test_share=0.5 --name=stdlib_bytes_heldout   # half of val as test
    python prepare_data.py openwebtext                   # -> data/openwebtext    (~9B tokens, downloads file by file)
    python prepare_data.py fineweb_edu                   # -> data/fineweb_edu    (sample-10BT: ~10B tokens)
    python prepare_data.py fineweb_edu --max_tokens=200000000   # a 200M-token cut: downloads only what it needs
    python prepare_data.py 'notes/*.txt' x.jsonl --name=mydata                   # -> data/mydata
    python prepare_data.py builtin --bench               # prepare speed vs raw tokenizer speed

Sources. `builtin`: pydoc's help topics (pydoc_data.topics) and the docstrings of the standard library's modules,
read with `ast` from the source files (nothing is imported, so `antigravity` opens no browser), in sorted order and
without site-packages: the same documents on every machine with the same Python version. `stdlib`: the source
of the standard library itself, its tests included (31.5 MB for Python 3.11, 14 times `builtin`), one document per
.py file, so the split into train and val is by module; the four test files written in other encodings on purpose
are left out. Its meta.json records the Python version and a SHA-256 of the text, so that runs on machines with
another stdlib can be told apart (preparing again there stops and names the difference). `openwebtext`: the Hugging
Face hub's parquet conversion of Skylion007/openwebtext (branch refs/convert/parquet). `fineweb_edu`:
HuggingFaceFW/fineweb-edu, its sample-10BT subset, or sample-100BT / sample-350BT with --subset. Hub files are read
one at a time: download, tokenize, delete, so the disk holds one of them beside the shards. Hub access goes through
huggingface_hub, so HF_TOKEN, HF_ENDPOINT (a mirror) and HF_HUB_CACHE work as they do everywhere (the tests point
HF_ENDPOINT at tests/hub_server.py, a local server of the hub's API); a file already in the user's cache is read
from there and kept. Without a network it stops with one line within seconds. Local files: .txt (a whole file is
one document), .jsonl (one document per line, its "text" field), .parquet (its "text" column); paths or globs.
Empty documents are dropped.

Split and shards (the format is in dataset.py). A document goes to val when a hash of (seed, its index in the corpus)
falls below val_fraction, so the split is fixed by the seed alone. With --test_share=s, a second hash sends a share s
of the val documents to a test split instead (test_<k>.bin), for numbers that no choice was made on; train is the same
as without it. meta.json records each split's SHA-256 (of its tokens, shard after shard). The corpus is cut into
chunks at the first document boundary where one split has shard_size tokens; a chunk is one shard per split that has
tokens in it (train_<k>.bin, val_<k>.bin), each written to a temporary name and renamed once complete.

Resume: after each chunk, progress.json records the shards written and where in the corpus the next chunk starts
(source file, document); meta.json replaces it at the end. Rerun with the same arguments, an interrupted run keeps
the finished shards and carries on from there (an unfinished chunk is simply redone, a cut-off download fetched
again). A hub source resumes from the same commit only: when the dataset has changed on the hub since, the rerun
says so and asks to start again.
"""

import argparse
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import time
from itertools import islice

import numpy as np
from tqdm import tqdm

from configurator import die, require
from dataset import FORMAT, HEADER_BYTES, MAGIC, SPLITS, VERSION, get_tokenizer, load_meta

BATCH_CHARS = 1 << 22  # text handed to the tokenizer at once: large enough to keep every thread busy
DEFAULT_VAL_FRACTION = {"openwebtext": 0.0005}  # nanoGPT's; other sources get 0.1 so a small corpus has a real val set
FINEWEB_EDU_SUBSETS = ("sample-10BT", "sample-100BT", "sample-350BT")
HUB_SOURCES = ("openwebtext", "fineweb_edu")
OFFLINE_SOURCES = ("builtin", "stdlib")  # made from the running Python alone: prepared on first use
HUB_TIMEOUT = 10  # seconds for the first request: without a network it fails fast instead of retrying for ~25 s


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


def parquet_documents(path, hub_file=None):
    """The "text" column, a record batch at a time: memory stays small however large the file. hub_file: the hub's
    name of a file downloaded to path, which is deleted after use; messages name it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pfile = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        fix = "the download is deleted; rerun to fetch it again" if hub_file else "download or write it again"
        die(f"{hub_file or path} is not a readable parquet file ({one_line(e)}): {fix}")
    schema = pfile.schema_arrow
    if "text" not in schema.names or not (pa.types.is_string(schema.field("text").type)
                                          or pa.types.is_large_string(schema.field("text").type)):
        columns = ", ".join(f"{field.name}: {field.type}" for field in schema)
        die(f"{hub_file or path} has no string column 'text' (columns: {columns}): put the documents in a string "
            f"column named text")
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
            die(f"source file not found: {pattern} (a source is builtin, stdlib, openwebtext, fineweb_edu, or "
                f".txt/.jsonl/.parquet files and globs)")
        for path in matches:
            if os.path.splitext(path)[1].lower() not in READERS:
                die(f"{path}: unsupported file type; use .txt (one document per file), .jsonl (a \"text\" field "
                    f"per line) or .parquet (a \"text\" column)")
        files += matches
    return files


def file_part(path):
    return path, lambda: READERS[os.path.splitext(path)[1].lower()](path)


def stdlib_files(tests=False):
    """The standard library's .py files, relative paths sorted; no installed packages, and no tests unless asked."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages"} | (set() if tests else {"test", "tests", "idle_test", "pydoc_data"})
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


def stdlib_source_texts():
    """The standard library's source files, tests included, as texts in path order; the files that are not UTF-8
    (tests of other source encodings) are left out, as the tokenizers take text."""
    root, files = stdlib_files(tests=True)
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def stdlib_parts():
    """(parts, what identifies the text): one part of every source file, and the Python version with a SHA-256 over
    the texts, which go into the dataset's settings so that another stdlib never mixes with this one."""
    digest = hashlib.sha256()
    for text in stdlib_source_texts():
        digest.update(text.encode("utf-8") + b"\0")
    info = dict(python=sys.version.split()[0], text_sha256=digest.hexdigest())
    return [("stdlib sources", stdlib_source_texts)], info


def one_line(error):
    return " ".join(str(error).split()) or type(error).__name__

def hub_location(source, subset):
    """(repository, revision, folders to take the parquet files from: the first that has any) of a hub source."""
    if source == "openwebtext":
        # the hub's parquet conversion needs no dataset script (datasets>=4 refuses to run one); of a large dataset
        # it may have converted only a part, into partial-train
        return "Skylion007/openwebtext", "refs/convert/parquet", ["plain_text/train/", "plain_text/partial-train/"]
    return "HuggingFaceFW/fineweb-edu", "main", [f"sample/{subset.removeprefix('sample-')}/"]  # e.g. sample/10BT/


def hub_failure(error, repo_id, endpoint):
    """(what went wrong, its fix) of a failed huggingface_hub call: by the HTTP status when the hub answered."""
    from huggingface_hub.errors import HfHubHTTPError
    response = error.response if isinstance(error, HfHubHTTPError) else None
    if response is None:  # no answer: refused, timed out, or not a hub (the client wraps the cause)
        return one_line(error.__cause__ or error), f"check the network and HF_ENDPOINT (now {endpoint}), then rerun"
    status = response.status_code
    reason = f"HTTP {status}" + (f" {one_line(error.server_message)}" if error.server_message else "")
    if status in (401, 403):  # the hub's answer to a gated or private dataset without a token that may read it
        return reason, (f"set HF_TOKEN to a token of an account that may read {repo_id} (a gated dataset: accept "
                        f"its terms on its page first), then rerun")
    if status == 404:
        return reason, f"check HF_ENDPOINT (now {endpoint}): it must serve the hub's {repo_id}"
    return reason, "the hub is not answering; rerun the same command later"


def hub_parquet_files(repo_id, revision, folders):
    """(commit, sorted parquet files of the first folder that has any) of a hub dataset. One short request first:
    huggingface_hub retries a failed listing for ~25 s, a dataset_info call with a timeout fails at once."""
    from huggingface_hub import HfApi  # imported here: train.py imports this module, and needs no hub
    api = HfApi()
    try:
        commit = api.dataset_info(repo_id, revision=revision, timeout=HUB_TIMEOUT).sha
        files = api.list_repo_files(repo_id, repo_type="dataset", revision=commit)
    except Exception as e:  # no network, a wrong HF_ENDPOINT, a gated repo without HF_TOKEN, ...: all one line
        reason, fix = hub_failure(e, repo_id, api.endpoint)
        die(f"cannot list {repo_id}@{revision}'s files at {api.endpoint} ({reason}): {fix}")
    for folder in folders:
        found = sorted(f for f in files if f.startswith(folder) and f.endswith(".parquet"))
        if found:
            if folder != folders[0]:
                print(f"warning: only {folder} exists in {repo_id}@{revision}; preparing that part", file=sys.stderr)
            return commit, found
    die(f"{repo_id}@{revision} has no parquet files in {' or '.join(folders)}: the hub layout changed")


def hub_parts(repo_id, revision, folders):
    """A part per parquet file, at the commit the revision points to now. A file already in the user's cache is read
    from there and kept; any other is downloaded into the cache and deleted after use. huggingface_hub (2.4.0)
    resumes a dropped connection within the download; a download that fails is deleted, so a rerun fetches that
    file from its start (and keeps the finished shards)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    commit, files = hub_parquet_files(repo_id, revision, folders)

    def part(filename):
        label = f"hf://datasets/{repo_id}@{commit}/{filename}"  # it names the commit: a resumed run reads the same

        def documents():
            cached = isinstance(try_to_load_from_cache(repo_id, filename, revision=commit, repo_type="dataset"), str)
            try:
                path = hf_hub_download(repo_id, filename, repo_type="dataset", revision=commit)
            except Exception as e:
                reason, fix = hub_failure(e, repo_id, constants.ENDPOINT)
                die(f"download of {filename} from {repo_id} failed ({reason}): {fix}; the finished shards are kept")
            try:
                yield from parquet_documents(path, hub_file=None if cached else label)
            finally:  # also when the run stops inside the file (--max_tokens): one downloaded file at a time on disk
                if not cached:
                    blob = os.path.realpath(path)  # the cache keeps the file as a blob and a link to it
                    os.remove(path)
                    if blob != os.path.abspath(path):
                        os.remove(blob)
        return label, documents
    return [part(filename) for filename in files]


# -----------------------------------------------------------------------------------------------------------------
# writing

def cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write_json(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def write_shard(path, pieces):
    """Header and tokens to a temporary name, then the final name: a file with that name is always complete."""
    n_tokens = sum(len(piece) for piece in pieces)
    with open(path + ".tmp", "wb") as f:
        f.write(np.array([MAGIC, VERSION, n_tokens, 0], dtype="<i8").tobytes())
        for piece in pieces:
            piece.tofile(f)
    os.replace(path + ".tmp", path)


def hashed_below(key, fraction):
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2**64


def split_of(doc_index, seed, val_fraction, test_share):
    """The split of a document: a hash of (seed, its index), so no RNG state runs through the corpus; of val's
    documents, another hash holds test_share out as test, leaving train as it is without a test split."""
    if not hashed_below(f"{seed}:{doc_index}", val_fraction):
        return "train"
    return "test" if test_share and hashed_below(f"test:{seed}:{doc_index}", test_share) else "val"


def split_sha256(out_dir, shards):
    """{split: SHA-256 of its tokens, shard after shard}: what identifies a split, whatever its shard size."""
    hashes = {}
    for split, files in shards.items():
        h = hashlib.sha256()
        for shard in files:
            with open(os.path.join(out_dir, shard["file"]), "rb") as f:
                f.seek(HEADER_BYTES)
                while block := f.read(1 << 24):
                    h.update(block)
        hashes[split] = h.hexdigest()
    return hashes


def documents_from(parts, start):
    """(position after it, text) of every non-empty document from position start = [part, document] on, and
    (position, None) where a part ends."""
    first_part, first_doc = start
    for p in range(first_part, len(parts)):
        _, documents = parts[p]
        texts = (t for t in documents() if t and not t.isspace())
        skip = first_doc if p == first_part else 0
        for i, text in enumerate(islice(texts, skip, None), skip):
            yield [p, i + 1], text
        yield [p + 1, 0], None


def batches(documents, max_documents, tokens_left):
    """Lists of (position, text), cut at BATCH_CHARS characters or max_documents documents, and where a part ends
    once the batch may hold tokens_left() tokens (a token is at least one UTF-8 byte: at most 4 per character, and
    one end of text per document): the next part, a download for a hub file, is opened only if it is needed."""
    batch, chars = [], 0
    for position, text in documents:
        if text is None:
            if batch and 4 * chars + len(batch) >= tokens_left():
                yield batch
                batch, chars = [], 0
            continue
        batch.append((position, text))
        chars += len(text)
        if chars >= BATCH_CHARS or len(batch) >= max_documents:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def make_settings(source, files, subset, enc, val_fraction, seed, shard_size, max_documents=None, max_tokens=None,
                  test_share=None):
    """What defines a dataset folder: a rerun with other settings must not mix with what is there. test_share is
    recorded only where given, so that folders prepared before it existed keep their settings."""
    settings = dict(source=source, files=files, subset=subset, tokenizer=enc.name, vocab_size=enc.n_vocab,
                    eot_token=enc.eot_token, val_fraction=val_fraction, seed=seed, shard_size=shard_size,
                    max_documents=max_documents, max_tokens=max_tokens)
    return dict(settings, test_share=test_share) if test_share else settings


def differing(settings, recorded):
    """The settings of a request that differ from a folder's (its meta.json or progress.json), as one string, each as
    "key=the folder's value there, the request's asked" (empty where none differs). A setting left out of one of them is
    None there: test_share, recorded only where given."""
    keys = dict.fromkeys([*settings, "test_share"])
    return ", ".join(f"{k}={recorded.get(k)!r} there, {settings.get(k)!r} asked" for k in keys
                     if recorded.get(k) != settings.get(k))


def new_state(settings, parts):
    return dict(settings=settings, parts=[label for label, _ in parts], next=[0, 0], documents={s: 0 for s in SPLITS},
                tokens={s: 0 for s in SPLITS}, shards={s: [] for s in SPLITS})


def tokenize_into(out_dir, parts, enc, state, num_threads=None, quiet=False):
    """Tokenize the documents from state["next"] on into chunks of shards; after each chunk, progress.json; at the
    end, meta.json. state holds the counts of what is written, so a resumed run continues them."""
    cfg = state["settings"]
    progress_path = os.path.join(out_dir, "progress.json")
    num_threads = num_threads or cpus()
    chunk = {s: [] for s in SPLITS}  # uint16 arrays, one per document: 200 MB for a 100M-token shard
    chunk_tokens = {s: 0 for s in SPLITS}

    def write_chunk(next_position):
        for split in SPLITS:
            if chunk_tokens[split]:
                name = f"{split}_{len(state['shards'][split]):06d}.bin"
                write_shard(os.path.join(out_dir, name), chunk[split])
                state["shards"][split].append(dict(file=name, tokens=chunk_tokens[split]))
            state["documents"][split] += len(chunk[split])
            state["tokens"][split] += chunk_tokens[split]
            chunk[split], chunk_tokens[split] = [], 0
        state["next"] = next_position
        write_json(progress_path, state)

    n_docs, n_tokens = sum(state["documents"].values()), sum(state["tokens"].values())
    max_docs, max_tokens = cfg["max_documents"] or float("inf"), cfg["max_tokens"] or float("inf")
    bar = tqdm(total=cfg["max_tokens"], initial=n_tokens, unit="tok", unit_scale=True, desc=out_dir, disable=quiet)
    for batch in batches(documents_from(parts, state["next"]), max_docs - n_docs, lambda: max_tokens - n_tokens):
        encoded = enc.encode_ordinary_batch([text for _, text in batch], num_threads=num_threads)
        for (position, _), tokens in zip(batch, encoded):
            tokens.append(enc.eot_token)
            split = split_of(n_docs, cfg["seed"], cfg["val_fraction"], cfg.get("test_share"))
            chunk[split].append(np.array(tokens, dtype="<u2"))
            chunk_tokens[split] += len(tokens)
            n_docs, n_tokens = n_docs + 1, n_tokens + len(tokens)
            if chunk_tokens[split] >= cfg["shard_size"]:
                write_chunk(position)
            if n_docs >= max_docs or n_tokens >= max_tokens:
                break
        part, _ = position
        bar.update(n_tokens - bar.n)
        bar.set_postfix_str(f"file {part + 1}/{len(parts)}", refresh=False)
        if n_docs >= max_docs or n_tokens >= max_tokens:
            break
    bar.close()
    if n_docs == 0:
        os.remove(progress_path)
        if not os.listdir(out_dir):
            os.rmdir(out_dir)
        die(f"no documents in {', '.join(state['parts'])}: every document is empty; check the files")
    write_chunk([len(parts), 0])
    meta = dict(cfg, format=FORMAT, version=VERSION, header_bytes=HEADER_BYTES, dtype="uint16",
                documents=state["documents"], tokens=state["tokens"], shards=state["shards"],
                split_sha256=split_sha256(out_dir, state["shards"]))
    write_json(os.path.join(out_dir, "meta.json"), meta)
    os.remove(progress_path)
    return meta


def prepare(source="builtin", tokenizer="gpt2", out_dir=None, name=None, subset=None, val_fraction=None, seed=1337,
            shard_size=100_000_000, max_documents=None, max_tokens=None, num_threads=None, quiet=False,
            test_share=None, owner=None):
    """Prepare `source` ('builtin', 'openwebtext', 'fineweb_edu', or a list of .txt/.jsonl/.parquet paths and globs)
    into out_dir (default data/<name>) and return out_dir. Does nothing when the folder already holds this dataset,
    resumes an interrupted run with the same arguments, and stops with a one-line error (exit code 2) on bad input.
    owner: the command whose own corpus out_dir is (lab.sweep_phi's), for whom a folder of other settings is in the
    way, not a corpus to choose prepare_data.py's options for."""
    sources = [source] if isinstance(source, str) else list(source)
    kind = sources[0] if len(sources) == 1 and sources[0] in (*OFFLINE_SOURCES, *HUB_SOURCES) else "files"
    if kind == "fineweb_edu":
        subset = subset or FINEWEB_EDU_SUBSETS[0]
        if subset not in FINEWEB_EDU_SUBSETS:
            die(f"unknown fineweb_edu subset '{subset}': use {', '.join(FINEWEB_EDU_SUBSETS)}")
    elif subset is not None:
        die(f"--subset is for fineweb_edu only, not {' '.join(sources)}")
    files = expand_files(sources) if kind == "files" else None
    if kind in HUB_SOURCES:
        require("huggingface_hub", "pyarrow")
    elif any(path.lower().endswith(".parquet") for path in files or []):
        require("pyarrow")
    try:
        enc = get_tokenizer(tokenizer)
    except (ValueError, FileNotFoundError) as e:
        die(str(e))
    val_fraction = DEFAULT_VAL_FRACTION.get(kind, 0.1) if val_fraction is None else float(val_fraction)
    if not 0 <= val_fraction < 1:
        die(f"val_fraction must be in [0, 1), got {val_fraction}")
    if test_share is not None and not (0 < test_share < 1 and val_fraction > 0):
        die(f"test_share is the share of val's documents held out as test: it must be in (0, 1) with a val_fraction "
            f"above 0, got test_share={test_share} and val_fraction={val_fraction}")
    for key, value in dict(shard_size=shard_size, max_documents=max_documents, max_tokens=max_tokens).items():
        if value is not None and (not isinstance(value, int) or value < 1):
            die(f"{key} must be a positive integer, got {value!r}")
    if out_dir is None:
        default = kind if kind != "files" else os.path.splitext(os.path.basename(files[0]))[0]
        out_dir = os.path.join("data", name or default + ("_bytes" if tokenizer == "bytes" else ""))
    settings = make_settings(kind, files, subset, enc, val_fraction, seed, shard_size, max_documents, max_tokens,
                             test_share)
    if kind == "stdlib":
        stdlib, info = stdlib_parts()
        settings.update(info)
    log = (lambda *a: None) if quiet else print
    in_the_way = f"it is {owner}'s own corpus, which {owner} prepares: move the folder away or delete it" if owner \
        else None
    meta_path, progress_path = os.path.join(out_dir, "meta.json"), os.path.join(out_dir, "progress.json")
    if os.path.exists(meta_path):
        try:
            meta = load_meta(out_dir)
        except (ValueError, FileNotFoundError) as e:
            die(str(e))
        if changed := differing(settings, meta):
            die(f"{out_dir} already holds a dataset prepared with other settings ({changed}): " + (
                in_the_way or "prepare with its settings, delete it, or choose another folder with --name or --out"))
        log(f"{out_dir} is already prepared")
        return out_dir
    if os.path.exists(progress_path):
        try:
            with open(progress_path) as f:
                state = json.load(f)
            old = state["settings"]
        except (ValueError, KeyError, TypeError):
            die(f"{progress_path} is damaged: delete {out_dir} and prepare it again")
        if changed := differing(settings, old):
            die(f"{out_dir} holds an unfinished run with other settings ({changed}): " + (
                in_the_way or "rerun it with the same settings to finish it, or delete the folder"))
    elif os.path.isdir(out_dir) and glob.glob(os.path.join(out_dir, "*.bin")):
        die(f"{out_dir} holds .bin files but no meta.json or progress.json: " + (
            in_the_way or "delete it, or choose another folder with --name or --out"))
    else:
        state = None
    if kind == "builtin":
        parts = builtin_parts()
    elif kind == "stdlib":
        parts = stdlib
    elif kind in HUB_SOURCES:
        parts = hub_parts(*hub_location(kind, subset))  # the network only now that the folder says there is work to do
    else:
        parts = [file_part(path) for path in files]
    if state is None:
        state = new_state(settings, parts)
        os.makedirs(out_dir, exist_ok=True)
        write_json(progress_path, state)  # before any shard: a folder with shards and neither json is not ours
    else:
        if state["parts"] != [label for label, _ in parts]:
            die(f"the source files changed since the unfinished run in {out_dir}: delete the folder and start again")
        for counts, empty in (("documents", 0), ("tokens", 0), ("shards", [])):  # begun before test splits existed
            state[counts].setdefault("test", empty)
        log(f"resuming {out_dir}: {sum(len(s) for s in state['shards'].values())} finished shards kept")
    meta = tokenize_into(out_dir, parts, enc, state, num_threads, quiet)
    for split in SPLITS[:2] + (("test",) if test_share else ()):
        log(f"{out_dir} {split}: {meta['documents'][split]:,} documents, {meta['tokens'][split]:,} tokens "
            f"in {len(meta['shards'][split])} shard(s)")
    if meta["tokens"]["val"] == 0 and val_fraction > 0:
        print(f"warning: no document fell into val; raise --val_fraction (now {val_fraction})", file=sys.stderr)
    if test_share and meta["tokens"]["test"] == 0:
        print(f"warning: no document fell into test; raise --test_share (now {test_share})", file=sys.stderr)
    return out_dir


def prepare_builtin_if_missing(dataset):
    """train.py and sweep.py call this: the offline corpora (builtin, stdlib, each also as _bytes) are made from the
    running Python on first use; any other missing dataset is left to its command (load_meta names it)."""
    data_dir = os.path.join("data", dataset)
    source = dataset.removesuffix("_bytes")
    if source in OFFLINE_SOURCES and not os.path.isfile(os.path.join(data_dir, "meta.json")):
        print(f"preparing {data_dir} (offline, takes seconds)")
        prepare(source, tokenizer="bytes" if dataset.endswith("_bytes") else "gpt2", out_dir=data_dir)
    return data_dir


# -----------------------------------------------------------------------------------------------------------------
# benchmark and command line

def bench(tokenizer="gpt2", num_threads=None, repeats=5):
    """Tokens/s of preparing the builtin corpus (tokenize, split, write shards and json) next to one bare
    encode_ordinary_batch call over the same texts, both from documents already in memory."""
    enc = get_tokenizer(tokenizer)
    num_threads = num_threads or cpus()
    t0 = time.perf_counter()
    docs = [text for _, text in documents_from(builtin_parts(), [0, 0]) if text is not None]
    collect = time.perf_counter() - t0
    settings = make_settings("builtin", None, None, enc, val_fraction=0.1, seed=1337, shard_size=100_000_000)
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
    p.add_argument("source", nargs="+", help="builtin | stdlib | openwebtext | fineweb_edu | .txt/.jsonl/.parquet files, globs")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "bytes"])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--name", help="output folder data/<name> (default: the source, or the first file's stem; "
                                      "_bytes appended for --tokenizer=bytes)")
    where.add_argument("--out", help="output folder, exactly")
    p.add_argument("--subset", help=f"fineweb_edu's subset: {', '.join(FINEWEB_EDU_SUBSETS)} (default the first)")
    p.add_argument("--val_fraction", type=float, help="share of documents in val (0.0005 for openwebtext, else 0.1)")
    p.add_argument("--test_share", type=float, help="share of val's documents held out as a test split (train "
                                                     "unchanged); default none")
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
    prepare(args.source, tokenizer=args.tokenizer, out_dir=args.out, name=args.name, subset=args.subset,
            val_fraction=args.val_fraction, seed=args.seed, shard_size=args.shard_size,
            max_documents=args.max_documents, max_tokens=args.max_tokens, num_threads=args.num_threads,
            test_share=args.test_share)


if __name__ == "__main__":
    main()
