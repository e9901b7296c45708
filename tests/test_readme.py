"""Every command of the README's fenced blocks, run as a reader runs them: in the README's order, in one folder of
their own (the repository's files linked into it, the runs and their data written there), each one that fails
stopping the rest. A command runs as written, unless it is in one of the tables below:

SHORT: a command that takes minutes as written, or needs GPUs, and the `--key=value` arguments that make it short
    (one replaces the same key where the command has it, else it is added at the end).
ENV: variables a command runs with: the hub download goes to tests/hub_server.py's local hub, which serves a
    FineWeb-Edu of a few documents at the same place.
NOT_RUN: a command this test does not run, and what it checks of it instead.
A `pip install -r FILE` is not run: FILE and the files it includes exist, each line is a requirement, and the
packages installed here satisfy it; a `pip install --no-deps NAME==VERSION`: that version is installed here.

The commands run in one process of their own, started with the session (conftest.py's EARLY), in about a minute.
A `python` command runs in a child forked from it, as python would run it (its sys.argv, sys.path[0], environment,
exit code and exit handlers), with torch imported once before: ~2 s a command. torchrun's and ENV's run in new
processes: their start is what is under test. Run alone, `python tests/test_readme.py FOLDER` runs them in FOLDER and
writes FOLDER/readme_runs.json.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from scripts import python_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the paper's and the lab's GPU models, a CPU's size: 2 blocks of width 64, context 64, 2 steps
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=2",
        "--gradient_accumulation_steps=2", "--max_iters=2", "--eval_interval=2", "--eval_iters=1"]
SHORT_TRAINING = ["--max_iters=20", "--eval_interval=20", "--eval_iters=2"]
SHORT = {
    # 1,200 steps, ~2 min: 20 steps and an evaluation on 2 batches, which writes the checkpoint that the later
    # commands read
    "python train.py config/smoke_cpu.py": SHORT_TRAINING,
    "python -m lab.train config/smoke_sampled.py": SHORT_TRAINING,
    # 1,500 steps, ~1 min each
    "python -m lab.train config/depth_cpu.py": SHORT_TRAINING,
    "python -m lab.train config/depth_sampled_cpu.py": SHORT_TRAINING,
    # 3 samples of 500 bytes through 4 loops, ~15 s each (sample.py's dtype=auto takes bfloat16 on this CPU)
    'python sample.py --out_dir=out-smoke --start="The " --n_loop=4': ["--max_new_tokens=50"],
    'python sample.py --out_dir=out-smoke-sampled --start="The " --n_loop=4': ["--max_new_tokens=50"],
    # 2 samples of 500 bytes, each step recomputing the whole context
    "python sample.py --out_dir=out-smoke --start=FILE:docs/prompt.txt --num_samples=2 --use_cache=False":
        ["--max_new_tokens=100"],
    # train.py has no dry run: the command itself on 2 CPU processes (DDP over gloo) with the model shrunk, on the
    # FineWeb-Edu that the command before prepared from the local hub
    "torchrun --standalone --nproc_per_node=8 train.py config/paper_small.py --n_loop=3 "
    "--out_dir=out-paper-small-deeploop-R3": ["--nproc_per_node=2", *TINY],
    "torchrun --standalone --nproc_per_node=8 train.py config/paper_small.py --n_loop=3 --residual=preln "
    "--out_dir=out-paper-small-preln-R3": ["--nproc_per_node=2", *TINY],
}
HUB_ENV = {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "5",
           "HF_HUB_DOWNLOAD_TIMEOUT": "5"}  # and HF_ENDPOINT, HF_HUB_CACHE, HF_HOME: the local hub's, this folder's
ENV = {"python prepare_data.py fineweb_edu": HUB_ENV}
TEST_COMMAND = "python -m pytest -q tests"
NOT_RUN = {TEST_COMMAND: "the suite itself, running now: .ci/run runs exactly the README line that holds it",
           "python -m lab.gpu_check": "a GPU machine's check: its CPU dry run (every check, the torchrun one on 2 "
                                      "processes) is tests/lab/test_gpu_check.py's"}


def readme_commands():
    """[(line, [its commands, split at &&, comments dropped])] of every non-empty line of README.md's fenced blocks,
    in order."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            command = re.split(r"\s+#", line)[0].strip()  # no README command has a # of its own
            if command:
                lines.append((line, [part.strip() for part in command.split("&&")]))
    return lines


def overridden(args, overrides):
    """args with each --key=value of overrides replacing the same key's argument, or added at the end."""
    args = list(args)
    for override in overrides:
        key = override.split("=")[0] + "="
        at = [i for i, arg in enumerate(args) if arg.startswith(key)]
        if at:
            args[at[0]] = override
        else:
            args.append(override)
    return args


def requirement_files(path):
    """[(file, its requirement lines)] of a requirements file and the files it includes with -r, in order."""
    with open(path) as f:
        lines = [line.split("#")[0].strip() for line in f]
    found, requirements = [], []
    for line in filter(None, lines):
        if line.startswith("-r "):
            found += requirement_files(os.path.join(os.path.dirname(path), line[3:].strip()))
        else:
            requirements.append(line)
    return [(path, requirements)] + found


def publish_fineweb_edu(hub):
    """A FineWeb-Edu of the standard library's help topics at the hub's place of the default subset."""
    from pydoc_data.topics import topics
    from test_prepare_data import FINEWEB, parquet_bytes
    texts = [topics[name] for name in sorted(topics)[:60]]
    hub.add(FINEWEB, {"sample/10BT/000_00000.parquet": parquet_bytes(texts)})


def run_all(folder):
    """Run the README's commands in folder -> a record per command run: README line, arguments, exit code,
    seconds, the output's last lines. Stops at the first that fails."""
    from hub_server import Hub
    for name in os.listdir(ROOT):
        if name not in (".git", "data") and not name.startswith(("out", "hf-")):
            os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
    # the offline corpus that conftest.py prepared, copied: preparing it takes ~10 s (tests/test_prepare_data.py's)
    if os.path.isfile(os.path.join(ROOT, "data", "builtin_bytes", "meta.json")):
        shutil.copytree(os.path.join(ROOT, "data", "builtin_bytes"), os.path.join(folder, "data", "builtin_bytes"))
    bin_dir = os.path.join(folder, ".bin")  # `python` is this interpreter; torchrun the one installed beside it
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "python"), "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(os.path.join(bin_dir, "python"), 0o755)
    path = os.pathsep.join([bin_dir, os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    hub = Hub()
    publish_fineweb_edu(hub)
    hub_env = dict(HF_ENDPOINT=hub.url, HF_HUB_CACHE=os.path.join(folder, ".hf_cache"),
                   HF_HOME=os.path.join(folder, ".hf_home"))
    records = []
    try:
        for line, commands in readme_commands():
            for command in commands:
                if command.startswith("pip install") or command in NOT_RUN:
                    continue
                args = overridden(shlex.split(command), SHORT.get(command, []))
                env = dict(os.environ, PATH=path)
                if command in ENV:  # no token or offline switch of this machine's: the local hub needs neither
                    env = {key: value for key, value in env.items()
                           if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
                    env.update(ENV[command], **hub_env)
                t0 = time.monotonic()
                if args[0] == "python" and command not in ENV:
                    with tempfile.TemporaryFile("w+") as log:
                        returncode = python_forked(args[1:], folder, env, 300, log, log)
                        log.seek(0)
                        output = log.read()
                else:
                    try:
                        result = subprocess.run(args, cwd=folder, env=env, capture_output=True, text=True,
                                                timeout=300)
                        returncode, output = result.returncode, result.stdout + result.stderr
                    except subprocess.TimeoutExpired as e:
                        returncode, output = "timeout after 300 s", str(e.stdout or "") + str(e.stderr or "")
                records.append(dict(line=line, command=command, args=args, returncode=returncode,
                                    seconds=round(time.monotonic() - t0, 1), output=output[-3000:]))
                if returncode != 0:
                    return records
    finally:
        hub.close()
    return records


EARLY = {"test_every_readme_command_runs": lambda folder: [[os.path.join("tests", "test_readme.py"), str(folder)]]}


def test_every_readme_command_runs(early):
    result, folder = early
    assert result.returncode == 0, result.stderr[-3000:]
    with open(folder / "readme_runs.json") as f:
        records = json.load(f)
    for record in records:
        assert record["returncode"] == 0, (f"README command `{record['command']}` failed (run as "
                                           f"{shlex.join(record['args'])}): {record['returncode']}\n{record['output']}")
    expected = [command for _, commands in readme_commands() for command in commands
                if not command.startswith("pip install") and command not in NOT_RUN]
    assert [record["command"] for record in records] == expected


def test_the_tables_name_readme_commands_only():
    commands = {command for _, commands in readme_commands() for command in commands}
    assert set(SHORT) | set(ENV) | set(NOT_RUN) <= commands


def test_ci_runs_the_readme_test_command_exactly():
    lines = [line for line, commands in readme_commands() if TEST_COMMAND in commands]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_commands = [line.strip() for line in f if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert lines and ci_commands == [re.split(r"\s+#", lines[0])[0].strip()]


def test_the_budget_studys_command_is_the_one_that_made_its_report():
    """The README's command for the finding as training grows is docs/runs/budget_study.md's, less what only rebuilt
    the report from the runs' file (--results_from, --report_only)."""
    with open(os.path.join(ROOT, "docs", "runs", "budget_study.md")) as f:
        made, = re.findall(r"Command: `([^`]*)`", f.read())
    made = " ".join(arg for arg in made.split() if not arg.startswith(("--results_from=", "--report_only=")))
    with open(os.path.join(ROOT, "README.md")) as f:
        assert re.findall(r"`(python -m lab\.sweep --mode=budget[^`]*)`", f.read()) == [made]


def test_every_pip_install_names_requirement_files_this_environment_satisfies():
    from importlib.metadata import PackageNotFoundError, version
    from packaging.requirements import Requirement
    installs = [command for _, commands in readme_commands() for command in commands
                if command.startswith("pip install")]
    assert installs
    for command in installs:
        args = shlex.split(command)
        if args[2] == "--no-deps":  # one package, pinned, whose dependencies a requirements file lists
            assert len(args) == 4 and re.fullmatch(r"[\w.-]+==[\w.+-]+", args[3]), command
            checked = [(command, [args[3]])]
        else:
            assert args[:3] == ["pip", "install", "-r"] and len(args) == 4, command
            assert os.path.isfile(os.path.join(ROOT, args[3])), f"{command}: no file {args[3]}"
            checked = requirement_files(os.path.join(ROOT, args[3]))
        for path, lines in checked:
            for line in lines:
                requirement = Requirement(line)
                try:
                    installed = version(requirement.name)
                except PackageNotFoundError:
                    installed = None
                assert installed and requirement.specifier.contains(installed, prereleases=True), (
                    f"{os.path.relpath(path, ROOT)}: {line}, installed here: {installed}")


if __name__ == "__main__":
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import torch  # noqa: F401 (for the children forked from here)
    runs = run_all(sys.argv[1])
    with open(os.path.join(sys.argv[1], "readme_runs.json"), "w") as f:
        json.dump(runs, f, indent=1)
    for run in runs:
        print(f"{run['seconds']:6.1f} s  exit {run['returncode']}  {shlex.join(run['args'])}")


def test_the_corpora_it_names_include_the_budget_studys_and_it_stays_short():
    with open(os.path.join(ROOT, "README.md"), "rb") as f:
        text = f.read()
    assert b"`python prepare_data.py stdlib --tokenizer=bytes`" in text
    assert len(text) < 12 * 1024
