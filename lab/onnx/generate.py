"""
Generate text with the DeepLoop model in this folder, written by `python -m lab.export_onnx`. It needs onnxruntime and
numpy (and tiktoken for a model of GPT-2 tokens), not PyTorch:

    pip install onnxruntime numpy          # and tiktoken, where config.json's tokenizer is gpt2
    python generate.py --start="Once upon a time" --max_new_tokens=200
    python generate.py --start="The " --top_k=1            # greedy: the tokens of the project's sample.py --top_k=1

model.onnx is the model unrolled at config.json's n_loop loops, with a KV cache entry per unrolled visit among its
inputs and outputs (past.i.key/value -> present.i.key/value), any batch and length. Sampling follows the project's
GPT.generate_stream: the prompt is read once, then each step feeds the newest token; past block_size the window slides
(the cache is refilled from the last block_size tokens). dataset.py is the project's tokenizer code.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dataset import ByteTokenizer, load_gpt2, valid_text  # noqa: E402  (this folder's copy)


class Generator:
    """The model of a folder (its config.json and model.onnx) in an ONNX Runtime session. The caches stay ONNX
    Runtime's between steps (I/O binding): a step's present.* are bound as the next step's past.*, never copied out."""

    def __init__(self, folder=HERE, threads=0, optimization="all", profile=False):
        with open(os.path.join(folder, "config.json")) as f:
            self.config = json.load(f)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's choice, a thread per physical core
        options.graph_optimization_level = dict(
            none=ort.GraphOptimizationLevel.ORT_DISABLE_ALL, basic=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            extended=ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            all=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)[optimization]
        options.enable_profiling = profile  # a JSON trace of every node's time, written at end_profiling()
        options.profile_file_prefix = os.path.join(tempfile.gettempdir(), "deeploop_onnx_profile")
        self.session = ort.InferenceSession(os.path.join(folder, "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        self.tokenizer = load_gpt2(folder) if self.config["tokenizer"] == "gpt2" else ByteTokenizer()

    def empty_cache(self, batch):
        c = self.config
        empty = np.zeros((batch, c["n_head"], 0, c["head_size"]), np.float32)
        return [ort.OrtValue.ortvalue_from_numpy(empty) for _ in range(2 * c["visits"])]

    def logits(self, ids, cache):
        """The last position's logits (B, n_vocab) of ids (B, T) after the cache's positions -> (logits, new cache)."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        for i, value in enumerate(cache):
            binding.bind_ortvalue_input(f"past.{i // 2}.{('key', 'value')[i % 2]}", value)
        for output in self.session.get_outputs():
            binding.bind_output(output.name)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return outputs[0].numpy(), outputs[1:]

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None):
        """Yield the sampled tokens (B, 1) of the prompts idx (B, T) one step at a time, as GPT.generate_stream:
        top_k's candidates, the largest logit moved to 0, divided by temperature, softmax, one draw per row."""
        block_size, past = self.config["block_size"], 0
        rng = rng or np.random.default_rng()
        for _ in range(max_new_tokens):
            if 0 < past < block_size:
                ids = idx[:, -1:]
            else:  # the first step, and every step once the window slides: the whole cropped context
                cache, past = self.empty_cache(len(idx)), 0
                ids = idx[:, -block_size:]
            logits, cache = self.logits(ids, cache)
            past += ids.shape[1]
            logits = logits.astype(np.float64)
            if top_k is not None and top_k < logits.shape[1]:
                top = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
                logits = np.take_along_axis(logits, top, axis=1)
            else:
                top = None
            logits = (logits - logits.max(axis=1, keepdims=True)) / temperature
            probs = np.exp(logits)
            probs /= probs.sum(axis=1, keepdims=True)
            drawn = (probs.cumsum(axis=1) < rng.random((len(probs), 1))).sum(axis=1, keepdims=True)
            drawn = np.minimum(drawn, probs.shape[1] - 1)  # a cumulative sum a rounding short of 1
            idx_next = drawn if top is None else np.take_along_axis(top, drawn, axis=1)
            idx = np.concatenate((idx, idx_next), axis=1)
            yield idx_next


def main():
    parser = argparse.ArgumentParser(description="Generate text with this folder's DeepLoop model (ONNX Runtime).")
    parser.add_argument("--start", default="\n", help='the prompt, or "FILE:path" to read it from a file')
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200, help="sample among the top_k most likely; 0: all; 1: greedy")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime's threads; 0: its choice")
    args = parser.parse_args()
    if min(args.num_samples, args.max_new_tokens, args.top_k, args.threads) < 0 or not args.temperature > 0:
        parser.error("--num_samples, --max_new_tokens, --top_k and --threads must be >= 0, --temperature > 0")
    start = args.start
    if start.startswith("FILE:"):
        try:
            with open(start[len("FILE:"):], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"cannot read the prompt file {start[len('FILE:'):]} ({e}); name a UTF-8 text file")
    try:
        generator = Generator(threads=args.threads)
    except ImportError as e:  # tiktoken, for a model of GPT-2 tokens
        parser.error(f"this model's tokenizer needs {e.name} ({e}): pip install {e.name}")
    except (OSError, ValueError, KeyError, ort.capi.onnxruntime_pybind11_state.Fail,
            ort.capi.onnxruntime_pybind11_state.NoSuchFile, ort.capi.onnxruntime_pybind11_state.InvalidGraph) as e:
        parser.error(f"cannot load the model beside this script in {HERE} ({type(e).__name__}: {e}); keep "
                     f"generate.py in the folder lab.export_onnx wrote, or export it again")
    enc, config = generator.tokenizer, generator.config
    start = valid_text(start)
    idx = np.array([enc.encode_ordinary(start) or [config["eot_token"]]], dtype=np.int64)
    print(f"model.onnx: {config['n_loop']} loops (trained at {config['n_loop_trained']}), tokenizer "
          f"{config['tokenizer']}{', int8' if config['quantize'] else ''}", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    new_tokens, t0 = 0, time.time()
    for k in range(args.num_samples):
        sys.stdout.write(start)
        ids, printed = [], ""
        for token in generator.stream(idx, args.max_new_tokens, args.temperature, args.top_k or None, rng):
            ids.append(int(token[0, 0]))
            text = enc.decode(ids).rstrip("\ufffd")  # a cut UTF-8 character waits for the token that ends it
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
        sys.stdout.write(enc.decode(ids)[len(printed):] + "\n")
        if k < args.num_samples - 1:
            print("---------------")
        sys.stdout.flush()
        new_tokens += len(ids)
    dt = time.time() - t0
    print(f"{new_tokens} tokens in {dt:.2f} s ({new_tokens / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    main()
