"""
sample.py with the lab's decoding, which the lesson leaves out (lab/decode.py; docs/test_time_depth.md):

    python -m lab.sample --out_dir=out-smoke-sampled --exit_threshold=1e-3 --n_loop=8   # adaptive exit, at most 8 loops
    python -m lab.sample --out_dir=out-smoke-sampled --kv_cache=last_loop --n_loop=8    # a cache that does not grow

It runs the lesson's sample.py itself, unchanged, with LAB set to a Lab: the seam sample.py defines. Every setting of
sample.py works here too; these two are the Lab's.
"""

import os
import runpy
import sys

import torch

from configurator import die
from lab import decode

SETTINGS = dict(
    # > 0: adaptive exit (lab.decode.exit_logits): a token stops looping at the first loop whose next-token
    # distribution is within this KL of the previous loop's; n_loop is then the most loops a token runs
    exit_threshold=0.0,
    kv_cache="per_visit",  # the cache layout: per_visit, an entry per unrolled visit (exact); last_loop, one per block
)
SAMPLE_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sample.py")


class Lab:
    """What sample.py calls where LAB is set (its seam)."""

    def __init__(self):
        self.settings, self.loops_used = dict(SETTINGS), []

    def configure(self, run):
        """Check the lab's settings against sample.py's (its namespace); dies with one line."""
        self.exit_threshold, self.kv_cache = self.settings["exit_threshold"], self.settings["kv_cache"]
        self.use_cache = run["use_cache"]
        if not self.exit_threshold >= 0:
            die(f"--exit_threshold must be >= 0 (0 = off), got {self.exit_threshold}")
        if self.kv_cache not in decode.KV_CACHES:
            die(f"--kv_cache must be one of {', '.join(decode.KV_CACHES)}, got {self.kv_cache!r}")
        if not self.use_cache and (self.exit_threshold or self.kv_cache != "per_visit"):
            die("--exit_threshold and --kv_cache=last_loop work on the KV cache: drop --use_cache=False")
        if run["compile_step"] and (self.exit_threshold or self.kv_cache != "per_visit"):
            die("--compile_step compiles the plain decode step: with --exit_threshold or --kv_cache=last_loop use "
                "--compile=True, which compiles the blocks")

    def describe(self, loops):
        """How the run samples, for sample.py's line on what it loaded."""
        if self.exit_threshold and loops == 1:
            print("warning: adaptive exit at most 1 loop: every token runs that one loop; set --n_loop above 1",
                  file=sys.stderr)
        at = f"adaptive exit at KL {self.exit_threshold:g}, at most {loops}" if self.exit_threshold else f"{loops}"
        return f"{at} loops, kv_cache {self.kv_cache}"

    def stream(self, model, x, max_new_tokens, temperature, top_k, loops, vocab_size_limit, next_logits):
        """The sampled tokens one at a time: the model's own generation (through next_logits, sample.py's compiled
        step, if set), or lab.decode's with adaptive exit or last_loop, the loops each token ran kept for report."""
        if not self.exit_threshold and self.kv_cache == "per_visit":
            return model.generate_stream(x, max_new_tokens, temperature, top_k, loops, self.use_cache,
                                         vocab_size_limit, next_logits=next_logits)
        return decode.generate_stream(model, x, max_new_tokens, temperature, top_k, loops, vocab_size_limit,
                                      self.exit_threshold, self.kv_cache, self.loops_used)

    def report(self, loops):
        """The loops the tokens ran, to stderr, under adaptive exit."""
        if self.loops_used:
            used = torch.cat(self.loops_used)
            counts = torch.bincount(used, minlength=loops + 1)
            print(f"loops per token: mean {used.float().mean():.2f}, " + ", ".join(
                f"{r}: {n}" for r, n in enumerate(counts.tolist()) if n) + " tokens", file=sys.stderr)


if __name__ == "__main__":
    sys.argv[0] = SAMPLE_PY
    runpy.run_path(SAMPLE_PY, init_globals=dict(LAB=Lab()), run_name="__main__")
