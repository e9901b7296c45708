"""
Zero-shot downstream evaluation of a trained checkpoint: HellaSwag, LAMBADA, and any multiple-choice task
(PIQA, ARC, ...) written in a small generic jsonl format.

    python eval_downstream.py --out_dir=out-smoke --task=hellaswag                 # downloads the val set once
    python eval_downstream.py --out_dir=out-smoke --task=lambada --limit=500
    python eval_downstream.py --out_dir=out-smoke --task=hellaswag --n_loop=4      # test-time depth: 4 loops
    python eval_downstream.py --out_dir=out-smoke --task=multiple_choice --data=piqa_val.jsonl --batch_size=16

The last line on stdout is the result, in this form:
    hellaswag acc=<summed log-likelihood> acc_norm=<per token> n=<examples> n_loop=<loops run>
    lambada acc=<whole last word right> ppl=<per word> n=<examples> n_loop=<loops run>
what was loaded and the progress bar go to stderr.

How a choice is scored. Every task reduces to: which continuation does the model find most likely after a context?
The model reads context + " " + choice and we add up the log-probabilities of the choice's tokens only.
  acc       picks the choice with the highest summed log-probability;
  acc_norm  divides that sum by the choice's number of tokens first (per-token log-likelihood), which stops
            short choices from winning just because every extra token costs probability.
A choice's leading tokens that are only whitespace (the joining space, a token of its own in the bytes tokenizer)
count as context, so both tokenizers score the same thing: the tokens of the words. Contexts that do not fit in
block_size lose tokens from the LEFT; the choice itself is always scored whole. An empty context becomes the
document separator token, the position every training document starts from. The text is used as it is (no
HellaSwag clean-up); lm-evaluation-harness cleans HellaSwag's text and normalises acc_norm by characters rather
than tokens, so its numbers differ a little from these.

Data formats, one JSON object per line (blank lines are skipped; "label" may also be a numeric string like "2"):
  hellaswag        the published file: {"ctx": str, "endings": [4 str], "label": int, ...other fields ignored}
                   (default: downloads hellaswag_val.jsonl into --cache_dir)
  lambada          {"text": str}: the last word is the text after the last space; it counts as right only when
                   every token of it is the model's greedy (argmax) choice given the true text before it. ppl is
                   exp of the mean negative log-likelihood of the whole last word (per word, not per token).
                   (default: downloads OpenAI's lambada_test.jsonl, the detokenized LAMBADA test set)
  multiple_choice  {"context": str, "choices": [str, str, ...], "label": int}, any number (>= 2) of choices,
                   which may differ between lines. Needs --data.

Converting PIQA and ARC into the multiple_choice format (the lm-evaluation-harness prompts):
  PIQA (valid.jsonl with {"goal", "sol1", "sol2"} and the labels, one int per line, in valid-labels.lst):
      {"context": "Question: " + goal + "\\nAnswer:", "choices": [sol1, sol2], "label": int(label_line)}
  ARC-Easy / ARC-Challenge (the AI2 jsonl, {"question": {"stem", "choices": [{"text", "label"}, ...]},
  "answerKey"}):
      {"context": "Question: " + stem + "\\nAnswer:", "choices": [c["text"] for c in choices],
       "label": [c["label"] for c in choices].index(answerKey)}
  (ARC's answer keys are letters, sometimes digits "1".."4": look the key up among the choice labels.)
"""

import json
import math
import os
import sys
import urllib.request
from contextlib import nullcontext

import torch
from torch.nn import functional as F
from tqdm import tqdm

from common import autocast_context, choose_dtype, tune_malloc
from configurator import configure, die
from dataset import get_tokenizer
from model import GPT

out_dir = "out"  # the train.py run to evaluate: reads out_dir/ckpt.pt
task = "hellaswag"  # hellaswag | lambada | multiple_choice
data = ""  # a local jsonl file; "" downloads the task's published file (hellaswag, lambada) into cache_dir
cache_dir = "data"  # where downloads are kept, so that only the first run needs the network
download_timeout = 10.0  # seconds; offline, the download fails after at most about this long
limit = 0  # evaluate only the first `limit` examples; 0 evaluates them all
n_loop = 0  # loops over the stack of blocks at test time; 0 runs the count the model was trained with
batch_size = 1  # examples per forward pass (all choices of an example always share one); more is faster on a GPU
device = "cuda" if torch.cuda.is_available() else "cpu"  # or cpu, cuda:1, mps
dtype = "auto"  # auto: what the device computes fastest (common.choose_dtype); or float32, bfloat16, float16

TASKS = ("hellaswag", "lambada", "multiple_choice")
URLS = {
    "hellaswag": "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl",
    "lambada": "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl",
}
# the field names holding (context, choices, label) in each choice task's files
CHOICE_FIELDS = {"hellaswag": ("ctx", "endings", "label"), "multiple_choice": ("context", "choices", "label")}


def download(url, path, timeout):
    """The cached copy of url at path, downloading it first if it is not there yet."""
    if os.path.isfile(path):
        return path
    print(f"downloading {url} -> {path}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read()
    except (OSError, ValueError) as e:  # URLError, timeouts and refused connections are all OSErrors
        reason = " ".join(str(getattr(e, "reason", e)).split())  # one line, whatever the platform's message
        die(f"could not download {url} ({reason}); when offline, fetch the file elsewhere and pass "
            f"--data=path/to/file.jsonl")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "wb") as f:  # write aside, then rename: an interrupted download never looks cached
        f.write(body)
    os.replace(path + ".tmp", path)
    return path


def read_records(task, path, limit=0):
    """The examples of a task file as (where, context, choices, label); LAMBADA's become (where, text before the
    last word, [last word], 0). Checks every line and stops at the first bad one with `path:N: problem`."""
    if not os.path.isfile(path):
        die(f"no data file at {path}; pass --data=path/to/file.jsonl")
    records = []
    with open(path, "rb") as f:  # bytes, so that a line that is not UTF-8 is reported like any other bad line
        for lineno, line in enumerate(f, 1):
            if limit and len(records) == limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are no UTF-8
                die(f"{where}: not valid JSON ({' '.join(str(e).split())}); each line must be one UTF-8 JSON object")
            if not isinstance(obj, dict):
                die(f"{where}: expected a JSON object, got {type(obj).__name__}")
            records.append((where, *(parse_lambada(obj, where) if task == "lambada" else
                                     parse_choices(obj, CHOICE_FIELDS[task], where))))
    if not records:
        die(f"{path} holds no examples; expected one JSON object per line")
    return records


def parse_lambada(obj, where):
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        die(f'{where}: expected a non-empty string field "text" (LAMBADA format: {{"text": str}})')
    text = text.strip()
    word = text.rsplit(" ", 1)[-1]
    return text[:-len(word)], [word], 0


def parse_choices(obj, fields, where):
    context_key, choices_key, label_key = fields
    expected = f'{{"{context_key}": str, "{choices_key}": [str, ...], "{label_key}": int}}'
    missing = [key for key in fields if key not in obj]
    if missing:
        die(f"{where}: missing field {', '.join(missing)}; expected {expected}")
    context, choices, label = obj[context_key], obj[choices_key], obj[label_key]
    if not isinstance(context, str):
        die(f'{where}: "{context_key}" must be a string, got {type(context).__name__}')
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c.strip() for c in choices)):
        die(f'{where}: "{choices_key}" must be a list of at least 2 non-empty strings')
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if type(label) is not int or not 0 <= label < len(choices):  # type(...) is int: refuses true/false
        die(f'{where}: "{label_key}" must be an index into "{choices_key}" (0..{len(choices) - 1}), got {label!r}')
    return context, choices, label


def encode_pair(enc, context, choice):
    """(context ids, choice ids) for scoring " " + choice after context."""
    ctx = enc.encode_ordinary(context.rstrip()) or [enc.eot_token]
    cont = enc.encode_ordinary(" " + choice.strip())
    while len(cont) > 1 and not enc.decode(cont[:1]).strip():  # whitespace-only tokens belong to the context
        ctx.append(cont.pop(0))
    return ctx, cont


def encode_records(records, enc, block_size):
    """Records -> examples ([(context ids, choice ids) for each choice], label), the form the scorer takes. (The
    context ids are the same for every choice unless a tokenizer merges the joining space differently.)"""
    examples = []
    for where, context, choices, label in records:
        pairs = [encode_pair(enc, context, choice) for choice in choices]
        longest = max(len(cont) for _, cont in pairs)
        if longest > block_size:  # at least one context token must precede the choice inside the window
            die(f"{where}: a choice is {longest} tokens long, more than the model's block_size {block_size}; "
                f"evaluate a model with a longer block_size or drop this example")
        examples.append((pairs, label))
    return examples


@torch.no_grad()
def score(model, rows, n_loop=0, n_vocab=None, autocast=nullcontext()):
    """Score rows [(context ids, continuation ids), ...] in ONE forward pass of shape (len(rows), T).
    Returns [(sum of the continuation's token log-probabilities, its number of tokens, whether every one of its
    tokens is the argmax), ...].

    Rows are right-padded to the longest one. Padding never changes a score: attention is causal, so a position
    only sees the positions before it, and the padding comes after every position we read. A row longer than the
    model's window keeps its last block_size + 1 tokens (the model reads all but the last, which is only a
    target), i.e. the context is cut from the left and the continuation stays whole."""
    block_size = model.config.block_size
    if any(len(cont) > block_size for _, cont in rows):  # encode_records has already said so, file and line
        raise ValueError(f"a continuation is longer than block_size {block_size}")
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
        logits, _ = model(idx.to(device), n_loop=n_loop or None)
    # only the positions that predict continuation tokens, in float32 even under autocast; ids from n_vocab up pad
    # the embedding (e.g. GPT-2's 50257 to 50304) and are no real tokens, so they are no candidates either
    logits = logits[torch.tensor(row, device=device), torch.tensor(pos, device=device), :n_vocab].float()
    targets = torch.tensor(targets, device=device)
    logprobs = F.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1).cpu()
    hits = (logits.argmax(dim=-1) == targets).cpu()
    sizes = [len(cont) for _, cont in rows]
    return [(lp.sum().item(), len(lp), bool(h.all()))
            for lp, h in zip(logprobs.split(sizes), hits.split(sizes))]


def scored_examples(model, examples, batch_size=1, progress=False, **kwargs):
    """Yield (example, [score of each of its choices]), scoring batch_size examples per forward pass: all the
    (context, choice) rows of those examples go into one batch."""
    bar = tqdm(total=len(examples), disable=not progress, unit="ex", file=sys.stderr)
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        scores = iter(score(model, [pair for pairs, _ in batch for pair in pairs], **kwargs))
        for example in batch:
            yield example, [next(scores) for _ in example[0]]
        bar.update(len(batch))
    bar.close()


def choice_accuracy(model, examples, **kwargs):
    """(acc, acc_norm) over examples ([(context ids, choice ids), ...], label)."""
    correct = correct_norm = 0
    for (_, label), scores in scored_examples(model, examples, **kwargs):
        # max over indices returns the first best one, so ties go to the earlier choice
        correct += max(range(len(scores)), key=lambda i: scores[i][0]) == label
        correct_norm += max(range(len(scores)), key=lambda i: scores[i][0] / scores[i][1]) == label
    return correct / len(examples), correct_norm / len(examples)


def lambada_accuracy(model, examples, **kwargs):
    """(acc, ppl) over examples ([(context ids, last word ids)], 0): a word is right when all its tokens are argmax."""
    correct, nll = 0, 0.0
    for _, [(logprob, _, greedy)] in scored_examples(model, examples, **kwargs):
        correct += greedy
        nll -= logprob
    nll /= len(examples)
    return correct / len(examples), math.exp(nll) if nll < 700 else math.inf  # math.exp overflows past ~709


# The script proper. It sits under this `if` (unlike sample.py) so that the tests can import the functions above.
if __name__ == "__main__":
    configure(globals(), sys.argv[1:])
    tune_malloc()  # before the first large allocation (common.tune_malloc)
    if task not in TASKS:
        die(f"unknown --task={task}; choose one of {', '.join(TASKS)}")
    for name, value in (("limit", limit), ("n_loop", n_loop)):
        if value < 0:
            die(f"--{name} must be >= 0, got {value}")
    if batch_size < 1:
        die(f"--batch_size must be >= 1, got {batch_size}")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        die(f"unknown --dtype={dtype}; choose auto, float32, bfloat16 or float16")
    dtype = choose_dtype(device, dtype)[0]
    if not data and task not in URLS:
        die(f"--task={task} needs --data=file.jsonl (one {{\"context\": str, \"choices\": [str, ...], "
            f"\"label\": int}} per line)")

    # read and check the data before the model: a bad line should not wait for a large checkpoint to load
    path = data or download(URLS[task], os.path.join(cache_dir, os.path.basename(URLS[task])), download_timeout)
    records = read_records(task, path, limit)

    try:
        model, checkpoint = GPT.from_checkpoint(os.path.join(out_dir, "ckpt.pt"), device)
    except (FileNotFoundError, ValueError) as e:
        die(str(e))
    model.eval()
    try:
        enc = get_tokenizer(checkpoint["tokenizer"])
    except (ValueError, FileNotFoundError) as e:
        die(str(e))
    if model.config.vocab_size < enc.n_vocab:
        die(f"{out_dir}/ckpt.pt has vocab_size {model.config.vocab_size}, too small for the {enc.name} tokenizer "
            f"({enc.n_vocab} tokens)")
    examples = encode_records(records, enc, model.config.block_size)

    autocast = autocast_context(device, dtype)
    cfg = model.config
    loops = n_loop or cfg.n_loop
    print(f"{out_dir}/ckpt.pt: {cfg.n_layer} blocks x {cfg.n_loop} loops trained, evaluating with {loops} loops "
          f"(unrolled depth {cfg.n_layer * loops}), tokenizer {enc.name}, iter {checkpoint.get('iter_num')}; "
          f"{task}: {len(examples)} examples from {path}", file=sys.stderr)

    kwargs = dict(batch_size=batch_size, progress=True, n_loop=loops, n_vocab=enc.n_vocab, autocast=autocast)
    if task == "lambada":
        acc, ppl = lambada_accuracy(model, examples, **kwargs)
        print(f"{task} acc={acc:.4f} ppl={ppl:.2f} n={len(examples)} n_loop={loops}")
    else:
        acc, acc_norm = choice_accuracy(model, examples, **kwargs)
        print(f"{task} acc={acc:.4f} acc_norm={acc_norm:.4f} n={len(examples)} n_loop={loops}")
