"""
Generation of one model through four engines side by side: vLLM (lab.vllm_model, over its paged KV cache), the
project's GPT.generate (model.py's per-visit cache), transformers' generate (the lab.export_hf folder's remote code,
which runs model.py's cache too) and ONNX Runtime (the lab.export_onnx folder's generate.py: the graph unrolled at
the trained loop count, its caches kept in ONNX Runtime between steps by I/O binding). Tokens/s for each count of
concurrent sequences, and the decode step of one sequence against its memory floor.

    python -m lab.bench_engines                            # the bench model of lab.bench, random weights
    python -m lab.bench_engines --out_dir=out-smoke --gen_tokens=64   # a trained checkpoint (its vocabulary)
    python -m lab.bench_engines --sequences=1,8 --engines=project,vllm --gen_tokens=64
    python -m lab.bench_engines --step_sequences=1,8,32  # the decode step of 8 and 32 sequences too (docs/speed.md)
    python -m lab.bench_engines --engines=onnx --onnx_optimization=basic --onnx_profile=True  # where its time goes

The checkpoint is exported (lab.export_hf, and lab.export_onnx for onnx) into a temporary folder, which vLLM,
transformers and ONNX Runtime load and which is removed at the end. Every engine gets the same prompts (prompt_len
random token ids each), samples gen_tokens new tokens per sequence (temperature 1, top_k; no end-of-text stop) in
float32 on the CPU threads torch has, and is timed on whole calls: the best of `repeats` calls for each count of
sequences, the prompt's pass included. A sequence's decode step is (the call for gen_tokens tokens - the call for one
token) / (gen_tokens - 1), for one sequence: what a token costs once the prompt is read; step_sequences times it for
more counts of sequences, each with a one-token call of its own. Its floor is the bytes a cached step must read
(lab.flops.decode_step_bytes, at the mean cache length of the generation, for as many sequences) over the memory's
read bandwidth measured here. Before timing, the engines decode one prompt greedily and the line says whether their
tokens agree.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, threads not pinned) with room for the largest count of
sequences; --vllm_eager=False lets it compile its graphs (vLLM's default), which costs start-up time. ONNX Runtime
runs on as many threads as torch, at the graph optimization level --onnx_optimization (all: its fusions, e.g.
LayerNorm with the residual's Add, Gelu with its bias); --onnx_profile=True turns its profiler on and prints the
share of the time of each operator type over the whole run.
"""

import os
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import asdict

import torch

from configurator import configure, die
from lab import require
from lab.flops import decode_step_bytes, read_bandwidth
from model import GPT, GPTConfig
from runtime import cpu_name

out_dir = ""           # a train.py run (its ckpt.pt) or a checkpoint file; empty: the bench model below
# the bench model (lab.bench's defaults), random weights, GPT-2's vocabulary
n_layer = 2
n_loop = 4
n_head = 4
n_embd = 256
block_size = 256
residual = "deeploop"
# the generation
engines = "vllm,project,transformers,onnx"
sequences = "1,8,32"   # counts of concurrent sequences
step_sequences = ""    # the counts among them whose decode step is timed and set against its floor; empty: 1
gen_tokens = 128       # new tokens per sequence
prompt_len = 16
top_k = 200
repeats = 3            # each cell is the best of this many calls
vllm_eager = True      # False: vLLM compiles (its default; start-up takes longer)
onnx_optimization = "all"  # ONNX Runtime's graph optimizations: none, basic, extended or all
onnx_profile = False   # True: ONNX Runtime's profiler on; the time per operator type is printed at the end
seed = 1337
configure(globals(), sys.argv[1:])

ENGINES = ("vllm", "project", "transformers", "onnx")
ONNX_OPTIMIZATIONS = ("none", "basic", "extended", "all")
GREEDY_TOKENS = 16  # the check that the engines agree before they are timed


def parsed_settings():
    """(engine list, sequence counts); raises ValueError naming the fix."""
    names = [e for e in engines.split(",") if e]
    if not names or not set(names) <= set(ENGINES):
        raise ValueError(f"--engines takes a list of {', '.join(ENGINES)}, got {engines!r}")
    try:
        counts = sorted({int(s) for s in str(sequences).split(",")})
        stepped = sorted({int(s) for s in str(step_sequences).split(",")}) if step_sequences else [1]
    except ValueError:
        counts, stepped = [], [0]
    if not counts or counts[0] < 1:
        raise ValueError(f"--sequences takes counts of sequences >= 1 like 1,8,32, got {sequences!r}")
    if step_sequences and not set(stepped) <= set(counts):
        raise ValueError(f"--step_sequences takes counts among --sequences ({sequences}), got {step_sequences!r}")
    if onnx_optimization not in ONNX_OPTIMIZATIONS:
        raise ValueError(f"--onnx_optimization takes one of {', '.join(ONNX_OPTIMIZATIONS)}, got {onnx_optimization!r}")
    if gen_tokens < 2 or prompt_len < 1 or repeats < 1 or top_k < 1:
        raise ValueError("need --gen_tokens >= 2, --prompt_len >= 1, --repeats >= 1 and --top_k >= 1")
    return names, counts, stepped


def bench_checkpoint(folder):
    """The bench model with random weights, saved as train.py saves a run -> the checkpoint's path."""
    torch.manual_seed(seed)
    config = GPTConfig(block_size=block_size, vocab_size=50304, n_layer=n_layer, n_loop=n_loop, n_head=n_head,
                       n_embd=n_embd, dropout=0.0, residual=residual)
    path = os.path.join(folder, "ckpt.pt")
    torch.save(dict(model=GPT(config).state_dict(), model_args=asdict(config), tokenizer="gpt2", optimizer={},
                    scaler=None, iter_num=0, best_val_loss=float("inf"), evaluated=False, rng=None,
                    program="deeploop-train", config=dict(dataset="random weights", loop_sampling="fixed")), path)
    return path


def exported(path, folder):
    """The checkpoint as lab.export_hf writes it into folder -> (the project's model, its tokenizer's vocabulary);
    raises ValueError where the prompts and their tokens do not fit in its context."""
    from lab.export_hf import load, write
    model, checkpoint, path, loops = load(path, folder)
    if prompt_len + max(gen_tokens, GREEDY_TOKENS) > model.config.block_size:
        raise ValueError(f"--prompt_len + --gen_tokens (at least {GREEDY_TOKENS}) must fit in the model's context "
                         f"({model.config.block_size})")
    with redirect_stdout(sys.stderr):
        write(model, checkpoint, path, folder, loops)
    from dataset import get_tokenizer
    return model, get_tokenizer(checkpoint["tokenizer"]).n_vocab


def project_engine(model, n_vocab):
    def generate(prompts, tokens, greedy=False):
        with torch.no_grad():
            out = model.generate(torch.tensor(prompts), tokens, top_k=1 if greedy else top_k,
                                 vocab_size_limit=n_vocab)
        return out[:, len(prompts[0]):].tolist()
    return generate


def transformers_engine(folder):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()

    def generate(prompts, tokens, greedy=False):
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, top_k=top_k, top_p=1.0, temperature=1.0)
        with torch.no_grad():
            ids = torch.tensor(prompts)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                              pad_token_id=hf.config.eos_token_id, **sampling)
        return out[:, len(prompts[0]):].tolist()
    return generate


def vllm_engine(folder, most, context):
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the bench's figures
    from lab.vllm_model import register
    register()
    from vllm import LLM, SamplingParams
    llm = LLM(model=folder, trust_remote_code=True, dtype="float32", max_model_len=context,
              enforce_eager=vllm_eager, max_num_seqs=most, kv_cache_memory_bytes=256 * 2**20, seed=seed)

    def generate(prompts, tokens, greedy=False):
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                                **(dict(temperature=0.0) if greedy else dict(temperature=1.0, top_k=top_k)))
        outs = llm.generate([dict(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def onnx_engine(path, folder):
    """The checkpoint as lab.export_onnx writes it into folder, run by the folder's own Generator -> (generate, the
    Generator)."""
    import numpy as np
    from lab.export_hf import load
    from lab.export_onnx import generator, write
    model, checkpoint, _, loops = load(path, folder)
    write(model, checkpoint, folder, loops)
    run = generator(folder, torch.get_num_threads(), onnx_optimization, onnx_profile)
    rng = np.random.default_rng(seed)

    def generate(prompts, tokens, greedy=False):
        steps = run.stream(np.array(prompts, dtype=np.int64), tokens, 1.0, 1 if greedy else top_k, rng)
        return np.concatenate(list(steps), axis=1).tolist()
    return generate, run


def onnx_profile_summary(run):
    """ONNX Runtime's trace of the run ended -> a line: the share of the nodes' time per operator type."""
    import json
    trace = run.session.end_profiling()
    with open(trace) as f:
        events = [e for e in json.load(f) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    os.remove(trace)
    per_op = {}
    for event in events:
        per_op[event["args"]["op_name"]] = per_op.get(event["args"]["op_name"], 0) + event["dur"]
    total = sum(per_op.values())
    return ", ".join(f"{op} {t / total:.0%}" for op, t in sorted(per_op.items(), key=lambda kv: -kv[1])
                     if t / total >= 0.01)


def best_call(generate, prompts, tokens):
    """Seconds of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = generate(prompts, tokens)
        best = min(best, time.perf_counter() - t0)
        assert len(out) == len(prompts) and all(len(o) == tokens for o in out)
    return best


if __name__ == "__main__":
    try:
        names, counts, stepped = parsed_settings()
        if "vllm" in names:
            from lab.vllm_model import INSTALL
            require("vllm", install=INSTALL)
        require("transformers", "safetensors", "tokenizers")  # every engine's model comes from the export_hf folder
        if "onnx" in names:
            require("onnx", "onnxruntime", "onnxscript")
    except ValueError as e:
        die(str(e))
    with tempfile.TemporaryDirectory(prefix="bench_engines.") as tmp:
        try:
            from lab.export_hf import checkpoint_path
            path, hf = out_dir and checkpoint_path(out_dir), os.path.join(tmp, "hf")
            checkpoint = path or bench_checkpoint(tmp)
            model, n_vocab = exported(checkpoint, hf)
        except (ValueError, FileNotFoundError) as e:
            die(str(e))
        cfg = model.config
        print(f"model: {path or 'the bench model, random weights'}: {cfg.n_layer} blocks x {cfg.n_loop} loops "
              f"({cfg.residual}), n_embd {cfg.n_embd}, {n_vocab} tokens, {model.num_params() / 1e6:.2f}M "
              f"parameters; float32 on {cpu_name()}, {torch.get_num_threads()} threads, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
        bandwidth = read_bandwidth("cpu")
        step_bytes = decode_step_bytes(model, 1, prompt_len + gen_tokens / 2, 4)
        floor = step_bytes / bandwidth
        floors = {n: decode_step_bytes(model, n, prompt_len + gen_tokens / 2, 4) / bandwidth for n in stepped}
        print(f"memory: reads {bandwidth / 1e9:.1f} GB/s; a cached decode step of one sequence reads "
              f"{step_bytes / 1e6:.3g} MB: floor {floor * 1e3:.3g} ms", flush=True)
        generator = torch.Generator().manual_seed(seed)
        prompts = torch.randint(n_vocab, (max(counts), prompt_len), generator=generator).tolist()
        started, engines_of, onnx_run = {}, {}, None
        for name in names:
            t0 = time.perf_counter()
            if name == "onnx":
                engines_of[name], onnx_run = onnx_engine(checkpoint, os.path.join(tmp, "onnx"))
            else:
                engines_of[name] = (vllm_engine(hf, max(counts), cfg.block_size) if name == "vllm" else
                                    project_engine(model, n_vocab) if name == "project" else transformers_engine(hf))
            started[name] = time.perf_counter() - t0
        greedy = {name: generate(prompts[:1], GREEDY_TOKENS, greedy=True)[0] for name, generate in engines_of.items()}
        agree = all(ids == greedy[names[0]] for ids in greedy.values())
        verdict = f"the same tokens from {', '.join(names)}" if agree else f"differ: {greedy}"
        print(f"greedy, {GREEDY_TOKENS} tokens of one prompt: {verdict}", flush=True)
        rows = []
        for name, generate in engines_of.items():
            ones = {n: best_call(generate, prompts[:n], 1) for n in stepped if n in counts}
            cells = {n: best_call(generate, prompts[:n], gen_tokens) for n in counts}
            steps = {n: (cells[n] - one) / (gen_tokens - 1) for n, one in ones.items()}
            rows.append((name, cells, steps))
            print(f"{name}: started in {started[name]:.1f} s, {torch.get_num_threads()} threads; " + ", ".join(
                f"{n} x {gen_tokens} tokens in {s:.3g} s ({n * gen_tokens / s:.0f} tokens/s)" for n, s in cells.items())
                + "".join(f"; decode step{f' of {n} sequences' if n > 1 else ''} {step * 1e3:.2f} ms, "
                          f"{step / floors[n]:.1f}x the floor" for n, step in steps.items()), flush=True)
        print()
        print("| engine | " + " | ".join(f"{n} seq, tokens/s" for n in counts) + " | " +
              " | ".join(f"decode step ({n} seq) | x floor" for n in stepped) + " |")
        print("|---|" + "---|" * (len(counts) + 2 * len(stepped)))
        for name, cells, steps in rows:
            print(f"| {name} | " + " | ".join(f"{n * gen_tokens / cells[n]:.0f}" for n in counts) + " | " + " | ".join(
                f"{steps[n] * 1e3:.2f} ms | {steps[n] / floors[n]:.1f}" if n in steps else "— | —" for n in stepped)
                + " |")
        if onnx_run is not None and onnx_profile:
            print(f"\nONNX Runtime's profiler, the nodes' time over the whole run: {onnx_profile_summary(onnx_run)}")
