"""
Downstream accuracy of a checkpoint, measured by EleutherAI's lm-evaluation-harness (`lm-eval`), the way the paper
reports it: the harness does every task's prompts, few-shot examples, metrics and standard errors; this file only
teaches it to run a model of this project (CheckpointLM below).

    python -m lab.eval_downstream --out_dir=out-loop_small                        # the 8 default tasks, 0-shot
    python -m lab.eval_downstream --out_dir=out-loop_small --num_fewshot=1        # ... 1-shot
    python -m lab.eval_downstream --out_dir=out-loop_small --tasks=hellaswag,piqa --limit=200 --n_loop=4
    python -m lab.eval_downstream --out_dir=out-smoke --include_path=docs/eval_demo --tasks=deeploop_demo   # offline

Prints the harness's table on stdout and writes the harness's results (without per-sample logs) to
out_dir/eval_<tasks>_<k>shot_loop<n_loop>_iter<checkpoint step>[_limit<N>].json: runs with other settings or
another checkpoint step never overwrite each other, and no evaluation overwrites an earlier one's result: one whose
file exists stops with one line before it runs (move the file aside to evaluate again). train.py's start_over moves
these files aside with the run's checkpoint (guard.RUN_FILES). Harness logs and progress go to stderr.

Tasks. The default list is the paper's downstream set as far as the paper names it (ARC-Challenge, HellaSwag, PIQA,
Winogrande, scored by `acc` at 0 and 1 shot), filled up to eight with the harness's usual small-model tasks:
arc_easy, arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, lambada_openai. Any task, group or tag the
harness knows works, and --include_path adds a folder of your own task YAMLs (docs/eval_demo/ is one: a local jsonl,
no network). The harness takes its tasks' data from the Hugging Face hub and caches it; when the hub cannot be
reached the script runs offline on what is cached, and stops with one line if a task's data is not there.

How the model is asked. Every task reduces to three requests, which CheckpointLM answers:
  loglikelihood(context, continuation)  log P(continuation | context), and whether greedy decoding would produce it.
      The harness splits the text into tokens (a context's trailing spaces go to the continuation); an empty
      context, also one that was only spaces, is the document separator, as in the harness's own models. Requests
      are sorted by length and batch_size of them run in one right-padded forward pass: attention is causal, so
      padding after a row never changes its scores. A context that does not fit in block_size loses tokens from the
      LEFT; the continuation is always scored whole, in pieces of block_size tokens if it is longer than that, each
      piece after as much of the text before it as fits.
  loglikelihood_rolling(text)  log P(text) after the document separator, for perplexity tasks: the same pieces are
      the harness's rolling windows (every token predicted once, each window as long as block_size allows).
  generate_until(context, until, max_gen_toks)  KV-cached generation, one request at a time (contexts differ in
      length), greedy unless the task asks for sampling; it stops at the first stop string (cut off), at the end of
      a document, or after max_gen_toks tokens.
Scores are computed in float32 even under a bfloat16/float16 autocast: the output layer runs outside autocast, as
bfloat16 logits come in steps of ~0.06 at a logit of 15, enough to flip close choices.
"""

import hashlib
import json
import logging
import os
import re
import socket
import sys
from contextlib import nullcontext
from urllib.parse import urlparse

import torch

from lab import require
require("lm_eval", "datasets", "huggingface_hub")  # before the lm_eval imports below, a traceback without it
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import normalize_gen_kwargs
from torch.nn import functional as F
from tqdm import tqdm

from configurator import configure, die
from runtime import check_device, precision, tune_malloc
from dataset import get_tokenizer
from model import check_loops
from guard import load_checkpoint
from lab.tasks import require_text

out_dir = "out"  # the train.py run to evaluate: reads out_dir/ckpt.pt, writes the results JSON there
tasks = "arc_easy,arc_challenge,hellaswag,piqa,winogrande,boolq,openbookqa,lambada_openai"  # comma list
num_fewshot = 0  # examples shown before each question (the paper reports 0 and 1)
limit = 0  # evaluate only the first `limit` examples of each task (for a quick look; 0 = all)
n_loop = 0  # loops over the stack of blocks at test time; 0 runs the count the model was trained with
batch_size = 16  # requests per forward pass; more is faster on a GPU
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "auto"  # auto: what the device computes fastest (runtime.choose_dtype); scores are float32 anyway
include_path = ""  # a folder of your own task YAMLs, added to the harness's
seed = 1234  # the harness's seeds (few-shot sampling, and any sampling a task asks for)
hub_timeout = 3.0  # seconds to wait for the Hugging Face hub before running offline on cached task data


class Float32Head(torch.nn.Module):
    """The output layer in float32 outside autocast, cut to the tokenizer's ids: ids from n_vocab up only pad the
    embedding (e.g. GPT-2's 50257 to 50304), are no tokens, and must be neither scored nor generated."""

    def __init__(self, head, n_vocab):
        super().__init__()
        self.head, self.n_vocab = head, n_vocab

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.head.weight[:self.n_vocab].float())


@torch.no_grad()
def score(model, rows, n_loop=None, autocast=nullcontext()):
    """[(sum of the continuation's log-probabilities, whether every one of its tokens is the argmax), ...] for rows
    [(context ids, continuation ids), ...], continuations of at most block_size tokens, in ONE forward pass. Rows
    are right-padded to the longest; a row longer than the window keeps its last block_size + 1 tokens (the last
    one is only a target), i.e. the context is cut from the left."""
    block_size = model.config.block_size
    seqs = [(ctx + cont)[-(block_size + 1):] for ctx, cont in rows]
    idx = torch.zeros(len(seqs), max(len(s) for s in seqs) - 1, dtype=torch.long)  # pad id 0: never read
    row, pos, targets = [], [], []
    for i, ((_, cont), seq) in enumerate(zip(rows, seqs)):
        idx[i, :len(seq) - 1] = torch.tensor(seq[:-1])
        first = len(seq) - 1 - len(cont)  # the logits at position p predict token p + 1
        row += [i] * len(cont)
        pos += range(first, len(seq) - 1)
        targets += cont
    device = next(model.parameters()).device
    with autocast:
        logits, _ = model(idx.to(device), n_loop=n_loop)
    logits = logits[torch.tensor(row, device=device), torch.tensor(pos, device=device)].float()  # continuations only
    targets = torch.tensor(targets, device=device)
    logprobs = F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1).cpu()
    hits = (logits.argmax(dim=-1) == targets).cpu()
    sizes = [len(cont) for _, cont in rows]
    return [(lp.sum().item(), bool(h.all())) for lp, h in zip(logprobs.split(sizes), hits.split(sizes))]


class CheckpointLM(TemplateLM):
    """A model of this project as the harness's LM; TemplateLM turns text requests into token ids with tok_encode."""

    def __init__(self, model, enc, n_loop=0, batch_size=16, autocast=nullcontext()):
        super().__init__()
        model.eval()
        model.lm_head = Float32Head(model.lm_head, enc.n_vocab)  # the tied weight stays shared with the embedding
        self.model, self.enc, self.n_loop, self.batch_size, self.autocast = model, enc, n_loop or None, batch_size, \
            autocast
        self.block_size = model.config.block_size
        self._device = next(model.parameters()).device

    @property
    def eot_token_id(self):
        return self.enc.eot_token

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.enc.encode_ordinary(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False):
        """[(log P(continuation | context), greedy?)] for requests [(strings, context ids, continuation ids)]."""
        rows, owner = [], []  # continuations cut into pieces of at most block_size tokens
        for i, (_, context, continuation) in enumerate(requests):
            context = context or [self.prefix_token_id]  # every token is scored after one before it
            for start in range(0, len(continuation), self.block_size):
                rows.append((context + continuation[:start], continuation[start:start + self.block_size]))
                owner.append(i)
        # longest first: a batch holds rows of similar length (little padding), and the largest batch runs first,
        # so that running out of memory shows at once
        order = sorted(range(len(rows)), key=lambda r: -min(len(rows[r][0]) + len(rows[r][1]), self.block_size))
        totals = [[0.0, True] for _ in requests]
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, unit="batch",
                          desc="loglikelihood", file=sys.stderr):
            batch = order[start:start + self.batch_size]
            for r, (logprob, greedy) in zip(batch, score(self.model, [rows[r] for r in batch], self.n_loop,
                                                         self.autocast)):
                totals[owner[r]][0] += logprob
                totals[owner[r]][1] &= greedy
        return [tuple(total) for total in totals]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        requests = [(args, [self.eot_token_id], self.tok_encode(args[0])) for args in (r.args for r in requests)]
        return [logprob for logprob, _ in self._loglikelihood_tokens(requests, disable_tqdm)]

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        outputs = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generate_until", file=sys.stderr):
            context, gen_kwargs = request.args
            gen_kwargs = normalize_gen_kwargs(gen_kwargs)
            until = [s for s in gen_kwargs["until"] if s]
            sampled = gen_kwargs["do_sample"] and gen_kwargs["temperature"] > 0
            ids = self.tok_encode(context)[-self.block_size:] or [self.eot_token_id]
            idx = torch.tensor([ids], device=self.device)
            new, text = [], ""
            with self.autocast:
                # top_k=1 is greedy decoding: the most likely token is the only candidate
                for token in self.model.generate_stream(idx, gen_kwargs["max_gen_toks"],
                                                        temperature=gen_kwargs["temperature"] if sampled else 1.0,
                                                        top_k=None if sampled else 1, n_loop=self.n_loop):
                    if token.item() == self.eot_token_id:
                        break
                    new.append(token.item())
                    text = self.enc.decode(new)
                    if any(stop in text for stop in until):
                        break
            outputs.append(min((text.split(stop)[0] for stop in until), key=len, default=text))
        return outputs

    def get_model_info(self):
        """What the harness records in the results' "config"."""
        cfg = self.model.config
        loops = self.n_loop or cfg.n_loop
        return dict(n_layer=cfg.n_layer, n_loop_trained=cfg.n_loop, n_loop=loops, unrolled_depth=cfg.depth(loops),
                    residual=cfg.residual, block_size=cfg.block_size, tokenizer=self.enc.name)


def hub_reachable(timeout):
    """Whether a TCP connection to the Hugging Face hub opens within timeout seconds (no request is sent). Read
    from the environment, not from huggingface_hub, which must only be imported once the offline switch is set."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except (OSError, ValueError):  # no DNS, refused, timed out; ValueError: an endpoint without a host
        return False


def hub_data_cached():
    """Whether the local Hugging Face caches hold any hub dataset at all (offline, only those can load): downloads
    sit in the hub cache as datasets--<owner>--<name>, prepared copies in the datasets cache as <owner>___<name>
    (next to builders of local files such as json/)."""
    from datasets import config
    from huggingface_hub import constants
    return any(os.path.isdir(folder) and any(name.startswith("datasets--") or "___" in name
                                             for name in os.listdir(folder))
               for folder in (constants.HF_HUB_CACHE, config.HF_DATASETS_CACHE))


def results_path(out_dir, task_names, num_fewshot, loops, iter_num, limit):
    """A file name that differs whenever the settings or the checkpoint step differ."""
    names = "+".join(re.sub(r"[^\w.-]", "_", os.path.basename(t).removesuffix(".yaml")) for t in task_names)
    if len(names) > 120:  # keep within file-name limits
        names = f"{len(task_names)}tasks-{hashlib.sha1(names.encode()).hexdigest()[:10]}"
    return os.path.join(out_dir, f"eval_{names}_{num_fewshot}shot_loop{loops}_iter{iter_num}"
                                 f"{f'_limit{limit}' if limit else ''}.json")


# The script proper. It sits under this `if` (unlike sample.py) so that the tests can import the class above.
if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    tune_malloc()  # before the first large allocation (runtime.tune_malloc)
    for name, value in (("limit", limit), ("num_fewshot", num_fewshot)):
        if value < 0:
            die(f"--{name} must be >= 0, got {value}")
    try:
        check_loops(n_loop, zero_is_trained=True)
    except ValueError as e:
        die(f"--{e}")
    if batch_size < 1:
        die(f"--batch_size must be >= 1, got {batch_size}")
    task_names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_names:
        die("--tasks is empty; name at least one task, e.g. --tasks=hellaswag")
    if include_path and not os.path.isdir(include_path):
        die(f"--include_path={include_path} is not a folder; point it at a folder of task YAML files")
    try:
        check_device(device)
        model, checkpoint = load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device)
        require_text(checkpoint, out_dir)
        # float32 on a CPU, whose scores also reproduce bit for bit
        dtype, dtype_reason, autocast = precision(device, dtype, untrained_because="scoring runs forward passes, not "
                                                  "the training steps auto's rule times")
    except (ValueError, FileNotFoundError) as e:
        die(str(e))
    try:
        enc = get_tokenizer(checkpoint["tokenizer"])
    except (ValueError, FileNotFoundError) as e:
        die(str(e))
    path = results_path(out_dir, task_names, num_fewshot, n_loop or model.config.n_loop, checkpoint.get("iter_num"),
                        limit)
    earlier = (f"{path} holds this evaluation of {out_dir}/ckpt.pt (step {checkpoint.get('iter_num')}) already: "
               f"move it aside or delete it to evaluate again")
    if os.path.exists(path):
        die(earlier)

    # Offline the harness's data loaders would retry the network; with the hub's offline switches (read when the
    # libraries are imported, hence before importing the harness) they use the cache at once.
    offline = not hub_reachable(hub_timeout)
    if offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    from lm_eval import __version__ as lm_eval_version
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table
    logging.getLogger("lm_eval").setLevel(logging.WARNING)

    # Tasks from --include_path or YAML paths are found at once; the harness's own ~14,000 YAML files take seconds
    # to index, so that is done only when a task needs it, and offline only when some hub data is cached at all.
    task_manager = TaskManager(include_path=include_path or None, include_defaults=False)
    hub_tasks = [t for t in task_names if t not in task_manager.all_tasks and not os.path.isfile(t)]
    if hub_tasks:
        if offline and not hub_data_cached():
            die(f"no data for {', '.join(hub_tasks)}: the Hugging Face hub cannot be reached and no hub dataset is "
                f"cached here{' (nor are they tasks of --include_path)' if include_path else ''}; run once with "
                f"network access, or evaluate local task files with --include_path=folder")
        task_manager = TaskManager(include_path=include_path or None)
        unknown = [t for t in hub_tasks if t not in task_manager.all_tasks]
        if unknown:
            die(f"unknown task {', '.join(unknown)}: not a task, group or tag of lm-eval {lm_eval_version}"
                f"{' or of --include_path' if include_path else ''}; list them with `lm-eval ls tasks`")
    lm = CheckpointLM(model, enc, n_loop, batch_size, autocast)
    cfg = model.config
    loops = n_loop or cfg.n_loop
    try:
        results = simple_evaluate(model=lm, tasks=task_names, num_fewshot=num_fewshot, batch_size=batch_size,
                                  device=device, limit=limit or None, log_samples=False, random_seed=seed,
                                  numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                                  task_manager=task_manager)
    except OSError as e:  # ConnectionError: offline, and this dataset is not cached; FileNotFoundError: data_files
        die(f"cannot load the task data ({' '.join(str(e).split())}); "
            f"{'run once with network access, or ' if offline else ''}check the task's dataset_path and data_files")
    print(f"{out_dir}/ckpt.pt: {cfg.n_layer} blocks x {cfg.n_loop} loops trained, evaluated with {loops} loops "
          f"(unrolled depth {cfg.depth(loops)}), tokenizer {enc.name}, iter {checkpoint.get('iter_num')}; "
          f"lm-eval {lm_eval_version}{' offline' if offline else ''}, {num_fewshot}-shot, {dtype} ({dtype_reason})",
          file=sys.stderr)
    results["config"].update(model_args=dict(out_dir=out_dir, iter_num=checkpoint.get("iter_num"), dtype=dtype))
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    tmp_path = f"{path}.{os.getpid()}.tmp"
    with open(tmp_path, "w") as f:  # written aside, then linked: an interrupted write never looks finished
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    try:
        os.link(tmp_path, path)  # fails where the file exists: an evaluation that ran meanwhile keeps its result
    except FileExistsError:
        die(earlier)
    finally:
        os.remove(tmp_path)
    print(f"results written to {path}", file=sys.stderr)
