"""
A checkpoint of this project as a folder that runs without PyTorch: ONNX Runtime, numpy and the tokenizer.

    python -m lab.export_onnx --out_dir=out-smoke --to=smoke-onnx                  # the trained loop count
    python -m lab.export_onnx --out_dir=out-smoke --to=smoke-onnx-8 --n_loop=8     # unrolled at 8 loops
    python -m lab.export_onnx --out_dir=out-smoke --to=smoke-onnx-int8 --quantize=int8
    cd smoke-onnx && python generate.py --start="Once upon a time" --top_k=1   # anywhere with onnxruntime and numpy

The folder holds model.onnx, config.json (the loop count it was exported at, the trained one, block size, vocabulary,
tokenizer, the cache's shape), generate.py (lab/onnx/generate.py: sampling as sample.py samples), dataset.py (the
project's tokenizers) and, for GPT-2 tokens, GPT-2's vocab files (encoder.json, vocab.bpe; tiktoken builds the
tokenizer from them offline).

The graph is model.py's own GPT, traced by torch.onnx's exporter (torch.export) through a wrapper that hands each
unrolled visit a cache made of its graph inputs: the forward pass at a fixed loop count with the loops unrolled (no
ONNX Loop operator), past.i.key/value in and present.i.key/value out for visit i, any batch and length, one graph for
the prompt and for every decode step. Its output is the last position's logits over the tokenizer's ids. Every
weight is stored once: the exporter folds each use of a matrix's transpose into a constant of its own (n_loop copies
of a looped block's weights), so identical constants are merged after export, and the token embedding, tied to the
output layer, is read from the output layer's transposed matrix. Before anything is written the script checks its
input; the folder is written aside and renamed into place (lab.export_hf.write_folder), then run by ONNX Runtime on a
probe and compared with the checkpoint's logits (over TOLERANCE is an error that removes it).

--quantize=int8 stores the matrices of the matrix products in int8 (ONNX Runtime's dynamic quantization: the
activations are quantized per step); the logit difference is then printed, not checked. --eval_iters=20 also prints
the val loss (train.py's evaluation windows) of the checkpoint and of the export, computed by a twin of its graph that
returns every position's logits (same loops, same quantization), at the exported loop count.

    python -m lab.export_onnx --out_dir=out-smoke --to=smoke-int8 --quantize=int8 --eval_iters=20
"""

import errno
import json
import logging
import os
import shutil
import signal
import sys
import warnings

import numpy as np
import torch

from configurator import configure, die
from dataset import get_tokenizer
from lab import require

out_dir = "out"       # the train.py run to export (its ckpt.pt), or the path of a checkpoint file
to = ""               # the folder to write; it must not exist, or be empty
n_loop = 0            # loops unrolled in the graph (0: the trained count)
quantize = ""         # int8: the matrix products' weights in int8 (dynamic quantization)
eval_iters = 0        # > 0: the val loss of the checkpoint and of this export's graph on as many batches of 8 windows
# lab.sample's decoding, which the graph does not hold: it runs every loop and keeps an entry per visit
exit_threshold = 0.0
kv_cache = "per_visit"

ONNX_FILES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onnx")
DATASET_FILE = os.path.join(os.path.dirname(os.path.dirname(ONNX_FILES)), "dataset.py")  # the project's tokenizers
TOLERANCE = 1e-4  # the largest logit difference from the checkpoint that a float32 export may have
OPSET = 23


class GraphCache:
    """A visit's cache in the graph: the past keys and values are graph inputs; update appends the new ones to them
    (model.KVCache's interface), and the result is the visit's present, a graph output."""

    def __init__(self, k, v):
        self.past_k, self.past_v, self.past = k, v, k.size(2)

    def update(self, k, v, block_size):
        self.k, self.v = torch.cat((self.past_k, k), dim=2), torch.cat((self.past_v, v), dim=2)
        return self.k, self.v


class Step(torch.nn.Module):
    """model.GPT at a fixed loop count, its caches given as tensors: (input_ids, past k, v of every visit) ->
    (logits of the tokenizer's ids at the last position, or at every position with last_only False; present k, v)."""

    def __init__(self, model, loops, n_vocab, last_only=True):
        super().__init__()
        self.model, self.loops, self.n_vocab, self.last_only = model, loops, n_vocab, last_only

    def forward(self, input_ids, *past):
        caches = [GraphCache(past[i], past[i + 1]) for i in range(0, len(past), 2)]
        logits, _ = self.model(input_ids, None, self.loops, caches, self.last_only)
        logits = logits[:, -1] if self.last_only else logits
        return (logits[..., :self.n_vocab], *[t for cache in caches for t in (cache.k, cache.v)])


def names(visits):
    """(input names, output names) of a graph with `visits` cache entries."""
    entries = [(i, part) for i in range(visits) for part in ("key", "value")]
    return ["input_ids", *[f"past.{i}.{part}" for i, part in entries]], \
        ["logits", *[f"present.{i}.{part}" for i, part in entries]]


def export_graph(model, path, loops, n_vocab, last_only=True):
    """The model unrolled at `loops` loops as an ONNX graph at path, each weight stored once (shared_weights)."""
    import onnx
    from torch.export import Dim
    cfg = model.config
    visits, head_size = cfg.depth(loops), cfg.n_embd // cfg.n_head
    # example shapes off the edges (2 rows, 3 new positions after 2 cached): model.py's attention takes its masked
    # path, which serves any past length, and no size is specialized to 0 or 1
    ids = torch.zeros(2, 3, dtype=torch.long)
    past = [torch.zeros(2, cfg.n_head, 2, head_size) for _ in range(2 * visits)]
    dynamic = {"input_ids": {0: Dim.DYNAMIC, 1: Dim.DYNAMIC},
               "past": tuple({0: Dim.DYNAMIC, 2: Dim.DYNAMIC} for _ in past)}
    inputs, outputs = names(visits)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed", per operator
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations
        program = torch.onnx.export(Step(model, loops, n_vocab, last_only).eval(), (ids, *past),
                                    dynamic_shapes=dynamic, input_names=inputs, output_names=outputs,
                                    opset_version=OPSET, dynamo=True, optimize=True, verbose=False)
    graph = program.model_proto
    for node in graph.graph.node:  # the exporter's notes per node (source lines, module names): 2/3 of the file
        del node.metadata_props[:]
        node.doc_string = ""
    shared_weights(graph)
    onnx.save(graph, path)


def shared_weights(graph):
    """Store each weight once, in place. The exporter writes a matrix's transpose either as a constant per use (a
    looped block's weights once per loop) or, for a matrix used twice such as the tied embedding, as a Transpose
    node that ONNX Runtime folds into a second copy when it loads the graph. So: every Transpose of a constant
    matrix becomes a constant, constants with equal bytes become one, and a Gather of the token embedding reads its
    rows, along the other axis, from the output layer's transposed matrix, so that the embedding is not kept too."""
    from onnx import helper, numpy_helper
    inits = graph.graph.initializer
    arrays = {init.name: init for init in inits}
    for node in list(graph.graph.node):
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type == "Transpose" and node.input[0] in arrays and perm == [1, 0]:
            inits.append(numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(arrays[node.input[0]]).T), node.output[0]))
            graph.graph.node.remove(node)
    first, renamed = {}, {}
    for init in list(inits):
        key = (init.data_type, tuple(init.dims), numpy_helper.to_array(init).tobytes())
        if key in first:
            renamed[init.name] = first[key]
            inits.remove(init)
        else:
            first[key] = init.name
    for node in graph.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    arrays = {init.name: numpy_helper.to_array(init) for init in inits}
    transposed_of = {(a.dtype, a.T.shape, a.T.tobytes()): name for name, a in arrays.items() if a.ndim == 2}
    for node in list(graph.graph.node):
        table = arrays.get(node.input[0]) if node.op_type == "Gather" else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is None or table.ndim != 2 or axis != 0 or node.input[1] != "input_ids":
            continue
        transposed = transposed_of.get((table.dtype, table.shape, np.ascontiguousarray(table).tobytes()))
        if transposed is None:
            continue
        # (C, V) gathered along V at the ids (B, T) -> (C, B, T) -> (B, T, C)
        gathered = node.output[0] + ".transposed"
        at = list(graph.graph.node).index(node)
        graph.graph.node.remove(node)
        graph.graph.node.insert(at, helper.make_node("Transpose", [gathered], [node.output[0]], perm=[1, 2, 0]))
        graph.graph.node.insert(at, helper.make_node("Gather", [transposed, node.input[1]], [gathered], axis=1))
    used = {name for node in graph.graph.node for name in node.input}
    for init in list(inits):
        if init.name not in used:
            inits.remove(init)


def initializer_bytes(path):
    """Bytes of the constants stored in the ONNX file at path."""
    import onnx
    from onnx import numpy_helper
    return sum(numpy_helper.to_array(init).nbytes for init in onnx.load(path).graph.initializer)


def parameter_bytes(model):
    """Bytes of the model's parameters in float32, each once (the tied embedding and output layer are one)."""
    return 4 * sum(p.numel() for p in model.parameters())


def quantize_int8(path):
    """The graph at path with its matrix products' weights in int8, in place (ONNX Runtime's dynamic quantization)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    quantized = path + ".int8"
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.ERROR)  # the quantizer's advice to pre-process, which is for image models
    try:
        quantize_dynamic(path, quantized, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"])
    finally:
        root.setLevel(level)
    os.replace(quantized, path)


def folder_config(model, checkpoint, loops, quantized):
    cfg, enc = model.config, get_tokenizer(checkpoint["tokenizer"])
    return dict(format="deeploop-onnx", n_loop=loops, n_loop_trained=cfg.n_loop, block_size=cfg.block_size,
                n_vocab=enc.n_vocab, eot_token=enc.eot_token, tokenizer=checkpoint["tokenizer"], n_head=cfg.n_head,
                head_size=cfg.n_embd // cfg.n_head, visits=cfg.depth(loops), quantize=quantized,
                residual=cfg.residual, n_layer=cfg.n_layer, n_prelude=cfg.n_prelude, n_coda=cfg.n_coda,
                iter_num=checkpoint["iter_num"], opset=OPSET, torch=torch.__version__.split("+")[0])


def fill_folder(model, checkpoint, loops, quantized, folder):
    from lab.export_hf import gpt2_vocab_dir
    enc = get_tokenizer(checkpoint["tokenizer"])
    export_graph(model, os.path.join(folder, "model.onnx"), loops, enc.n_vocab)
    if quantized:
        quantize_int8(os.path.join(folder, "model.onnx"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(folder_config(model, checkpoint, loops, quantized), f, indent=2)
        f.write("\n")
    shutil.copyfile(os.path.join(ONNX_FILES, "generate.py"), os.path.join(folder, "generate.py"))
    shutil.copyfile(DATASET_FILE, os.path.join(folder, "dataset.py"))
    if checkpoint["tokenizer"] == "gpt2":
        for name in ("encoder.json", "vocab.bpe"):
            shutil.copyfile(os.path.join(gpt2_vocab_dir(), name), os.path.join(folder, name))


def generator(folder, threads=0, optimization="all", profile=False):
    """The folder's own Generator (its generate.py), as a user runs it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"onnx_generate_{abs(hash(folder))}",
                                                  os.path.join(folder, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Generator(folder, threads, optimization, profile)


def max_logit_difference(model, folder, loops):
    """The largest difference between the folder's logits in ONNX Runtime and the checkpoint model's: a prompt of
    2 x 5 tokens, then one decode step from its cache."""
    run = generator(folder)
    n_vocab = run.config["n_vocab"]
    ids = torch.randint(n_vocab, (2, min(6, model.config.block_size)), generator=torch.Generator().manual_seed(0))
    prompt, step = ids[:, :-1], ids[:, -1:]
    got_prompt, cache = run.logits(prompt.numpy(), run.empty_cache(2))
    got_step, _ = run.logits(step.numpy(), cache)
    with torch.no_grad():
        caches = model.new_caches(loops)
        expected_prompt = model(prompt, None, loops, caches, True)[0][:, -1, :n_vocab]
        expected_step = model(step, None, loops, caches, True)[0][:, -1, :n_vocab]
    return max(float(np.abs(got - expected.numpy()).max())
               for got, expected in ((got_prompt, expected_prompt), (got_step, expected_step)))


def write(model, checkpoint, to, loops, quantized=""):
    """The folder, written aside and renamed to `to`, then run and compared -> the largest logit difference. A float32
    export over TOLERANCE raises ValueError and removes the folder."""
    from lab.export_hf import write_folder
    remove = write_folder(to, lambda folder: fill_folder(model, checkpoint, loops, quantized, folder))
    try:
        difference = max_logit_difference(model, to, loops)
    except BaseException:
        remove()
        raise
    if not quantized and not difference <= TOLERANCE:
        remove()
        raise ValueError(f"the ONNX graph's logits differ from the checkpoint's by {difference:.3g} (more than "
                         f"{TOLERANCE:g}): the export is wrong and was removed; report it with the checkpoint's "
                         f"settings")
    return difference


def val_losses(model, checkpoint, loops, quantized, iters, batch_size=8):
    """(the checkpoint's val loss, the ONNX graph's) on train.py's first `iters` val batches (EVAL_SEED), the graph
    exported with every position's logits into a temporary folder and quantized as the export is."""
    import tempfile
    import onnxruntime as ort
    from dataset import EVAL_SEED, TokenWindows
    cfg, n_vocab = model.config, get_tokenizer(checkpoint["tokenizer"]).n_vocab
    data = TokenWindows(os.path.join("data", checkpoint["config"]["dataset"]), "val", cfg.block_size, EVAL_SEED)
    empty = np.zeros((batch_size, cfg.n_head, 0, cfg.n_embd // cfg.n_head), np.float32)
    inputs, _ = names(cfg.depth(loops))
    with tempfile.TemporaryDirectory(prefix="export_onnx.") as tmp:
        path = os.path.join(tmp, "model.onnx")
        export_graph(model, path, loops, n_vocab, last_only=False)
        if quantized:
            quantize_int8(path)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        losses = []
        for i in range(iters):
            x, y = data.batch(i, batch_size)
            with torch.no_grad():
                expected = model.loss(model(x, n_loop=loops)[0][..., :n_vocab], y).item()
            logits = session.run(["logits"], {"input_ids": x.numpy(), **{name: empty for name in inputs[1:]}})[0]
            losses.append((expected, model.loss(torch.from_numpy(logits), y).item()))
    return tuple(float(np.mean(column)) for column in zip(*losses))


def check_settings():
    """The settings the export cannot hold -> raises ValueError naming what it supports."""
    if exit_threshold or kv_cache != "per_visit":
        raise ValueError("the ONNX export runs a fixed loop count with a KV cache entry per unrolled visit: adaptive "
                         "exit (--exit_threshold) and --kv_cache=last_loop are lab.sample's decoding, not exported; "
                         "drop them (--n_loop sets the loops)")
    if eval_iters < 0:
        raise ValueError(f"--eval_iters must be >= 0 (0: no evaluation), got {eval_iters}")
    if quantize not in ("", "int8"):
        raise ValueError(f"--quantize takes int8 (or nothing: float32), got {quantize!r}")


if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    require("onnx", "onnxruntime", "onnxscript")
    for signum in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C does: write() removes what it wrote
        signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))
    from lab.export_hf import load
    try:
        check_settings()
        model, checkpoint, path, loops = load(out_dir, to, n_loop=n_loop)
    except (ValueError, FileNotFoundError) as e:
        die(str(e).replace("e.g. --to=hf-smoke", "e.g. --to=smoke-onnx"))
    try:
        difference = write(model, checkpoint, to, loops, quantize)
    except ValueError as e:
        die(str(e))
    except OSError as e:  # a full disk, a folder that may not be written: nothing of the export is left
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        die(f"cannot write {to} ({e.strerror or e}): {'free some space or ' if full else ''}choose another --to")
    cfg = model.config
    stored, params = initializer_bytes(os.path.join(to, "model.onnx")), parameter_bytes(model)
    print(f"{to}: {path} (step {checkpoint['iter_num']}, {cfg.n_layer} blocks x {cfg.n_loop} loops trained) unrolled "
          f"at {loops} loops ({cfg.depth(loops)} visits), tokenizer {checkpoint['tokenizer']}"
          f"{', int8' if quantize else ''}; model.onnx {os.path.getsize(os.path.join(to, 'model.onnx')) / 1e6:.2f} "
          f"MB, constants {stored / 1e6:.2f} MB for {params / 1e6:.2f} MB of parameters; logits in ONNX Runtime "
          f"differ from the checkpoint's by at most {difference:.2g}")
    if eval_iters:
        try:
            expected, got = val_losses(model, checkpoint, loops, quantize, eval_iters)
        except (ValueError, FileNotFoundError) as e:  # no prepared dataset here: the folder is written all the same
            die(f"{e}; {to} is complete, only the val loss was not measured")
        print(f"val loss at {loops} loops, {eval_iters} batches of 8 windows: checkpoint {expected:.4f}, this export "
              f"({quantize or 'float32'}) {got:.4f}, change {got - expected:+.4f}")
