"""docs/deeploop.md, the lesson: every command in it runs (conftest.py's EARLY runner, each in a child forked from it,
as tests/test_readme.py runs the README's) and prints what the lesson shows below it, its numbers to 2% or to the
last digit shown; each exercise's expected outcome holds; every coefficient it names is model.residual_coefficients';
lab.lesson's bad settings are one-line errors."""

import math
import os
import re
import shlex

import pytest

from model import residual_coefficients
from scripts import ROOT, run_script

LESSON = os.path.join(ROOT, "docs", "deeploop.md")
NUMBER = re.compile(r"(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")


def lesson_blocks():
    """[(command, the output the lesson shows under it, or None: an exercise's)] of the lesson's console blocks."""
    with open(LESSON) as f:
        text = f.read()
    blocks = []
    for block in re.findall(r"^```console\n(.*?)^```", text, flags=re.S | re.M):
        command, *shown = block.rstrip("\n").split("\n")
        assert command.startswith("$ python "), command
        blocks.append((command[2:], "\n".join(shown) if shown else None))
    return blocks


SHOWN = [(command, shown) for command, shown in lesson_blocks() if shown is not None]
EXERCISES = [command for command, shown in lesson_blocks() if shown is None]
EARLY = {**{f"test_the_command_prints_what_the_lesson_shows[{i}]": (lambda folder, c=command: [shlex.split(c)[1:]])
            for i, (command, _) in enumerate(SHOWN)},
         **{f"test_exercise_{i + 1}": (lambda folder, c=command: [shlex.split(c)[1:]])
            for i, command in enumerate(EXERCISES)}}


def agree(shown, printed):
    """Whether a printed number agrees with the one shown: to 2%, or to the last digit shown, or both below 1e-9 (a
    rounding difference, which another CPU's float64 kernels print otherwise)."""
    a, b = float(shown), float(printed)
    if max(abs(a), abs(b)) < 1e-9:
        return True
    mantissa, _, exponent = shown.partition("e")
    decimals = len(mantissa.partition(".")[2])
    unit = 10.0 ** (int(exponent or 0) - decimals)
    return abs(a - b) <= max(0.02 * max(abs(a), abs(b)), unit)


def differences(shown, printed):
    """The lines where printed differs from shown: in its words, or in a number beyond agree's tolerance."""
    shown_lines, printed_lines = shown.splitlines(), printed.rstrip("\n").splitlines()
    if len(shown_lines) != len(printed_lines):
        return [f"{len(printed_lines)} lines printed, {len(shown_lines)} shown"]
    found = []
    for s, p in zip(shown_lines, printed_lines):
        s_parts, p_parts = NUMBER.split(s), NUMBER.split(p)
        if len(s_parts) != len(p_parts) or s_parts[::2] != p_parts[::2] or \
                not all(agree(a, b) for a, b in zip(s_parts[1::2], p_parts[1::2])):
            found.append(f"shown:   {s}\nprinted: {p}")
    return found


@pytest.mark.parametrize("i", range(len(SHOWN)))
def test_the_command_prints_what_the_lesson_shows(early, i):
    result, _ = early
    command, shown = SHOWN[i]
    assert result.returncode == 0, f"{command}:\n{result.stderr[-3000:]}"
    assert not differences(shown, result.stdout), "\n".join([command, *differences(shown, result.stdout)])


def test_every_command_of_the_lesson_is_run_and_none_of_its_commands_is_anything_but_lab_lesson():
    assert len(SHOWN) == 5 and len(EXERCISES) == 4
    assert all(command.startswith("python -m lab.lesson ") for command, _ in lesson_blocks())
    assert len(EARLY) == len(lesson_blocks())


def test_the_differences_test_catches_a_changed_number_or_word():
    assert not differences("kappa 1.9804, 5e-16", "kappa 1.9811, 3e-16\n")
    assert differences("kappa 1.9804", "kappa 2.1000")
    assert differences("exponent -0.00", "exponent 0.02")
    assert not differences("exponent -0.00", "exponent 0.01")
    assert differences("looped 1.00", "untied 1.00")


def printed_rows(stdout, first):
    """The rows of a check's table whose first field is first (a string), split into fields."""
    return [line.split() for line in stdout.splitlines() if line.split()[:1] == [first]]


def test_exercise_1(early):
    result, _ = early
    assert result.returncode == 0, result.stderr
    (p, R, N, alpha, beta, ratio, untied, looped), = [row for row in map(str.split, result.stdout.splitlines())
                                                      if row[:2] == ["0.50", "3"]]
    assert (int(R), int(N)) == (3, 36)
    expected_alpha, expected_beta = residual_coefficients("deeploop", 36)
    assert (float(alpha), float(beta)) == (pytest.approx(expected_alpha, abs=1e-4),
                                           pytest.approx(expected_beta, abs=1e-4))
    assert expected_alpha == pytest.approx(math.sqrt(72)) and expected_beta == pytest.approx(1 / math.sqrt(288))
    assert float(looped) == pytest.approx(1 / (16 * 12), abs=1e-4) == pytest.approx(0.0312 / 6, abs=1e-4)


def test_exercise_2(early):
    result, _ = early
    assert result.returncode == 0, result.stderr
    sgd = re.search(r"SGD: +looped (\S+) \(.*\), untied (\S+) ", result.stdout)
    assert (float(sgd[1]), float(sgd[2])) == (pytest.approx(-2, abs=0.02), pytest.approx(-3, abs=0.02))
    row_4 = printed_rows(result.stdout, "4")[0]
    assert float(row_4[4]) == pytest.approx(4, abs=0.02) == pytest.approx(float(row_4[1]), abs=0.02)
    assert 1.05 < float(row_4[8]) < 1.2  # AdamW's ratio, its gradients near its eps


def test_exercise_3(early):
    result, _ = early
    assert result.returncode == 0, result.stderr
    trained = result.stdout.split("step  kappa_R")[1].splitlines()[1:]
    kappa = {int(step): float(k) for step, k, _ in map(str.split, trained)}
    assert list(kappa) == list(range(0, 80, 10))
    assert min(kappa[0], kappa[10], kappa[20]) > 1.9
    assert kappa[50] < 1.5 and kappa[70] < 1.2


def test_exercise_4(early):
    result, _ = early
    assert result.returncode == 0, result.stderr
    rows = printed_rows(result.stdout, "layernorm") + printed_rows(result.stdout, "rmsnorm")
    assert len(rows) == 6
    for _, R, N, alpha, tensors, block in rows:
        assert float(alpha) == pytest.approx(residual_coefficients("deeploop", int(N))[0], abs=1e-4)
        expected = 1e-5 * (1 - 1 / float(alpha) ** 2) / 2
        assert float(tensors) == pytest.approx(expected, rel=0.06), (R, tensors, expected)
        assert float(block) == pytest.approx(expected, rel=0.06), (R, block, expected)


def test_the_coefficients_the_lesson_names_are_residual_coefficients():
    with open(LESSON) as f:
        text = f.read()
    table = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", text, flags=re.M)
    assert [int(row[0]) for row in table] == [2, 4, 8, 36]
    for N, *named in table:
        computed = residual_coefficients("deepnorm", int(N)) + residual_coefficients("deeploop", int(N))
        assert [float(v) for v in named] == pytest.approx(computed, abs=1e-4), N
    for N in (2, 4, 8, 36, 96):
        for p in (0.25, 0.5, 1.0):
            alpha, beta = residual_coefficients("deeploop", N, p)
            assert beta / alpha == pytest.approx((4 * N) ** (-2 * p))  # section 2's beta / alpha = (4N)^(-2p)
        assert N * (residual_coefficients("deepnorm", N)[1] / residual_coefficients("deepnorm", N)[0]) ** 2 == \
            pytest.approx(0.25)  # DeepNorm holds N (beta/alpha)^2 at 1/4
        for L in (1, 2, 12):  # and DeepLoop R N (beta/alpha)^2 at 1/(16 L), whatever R
            alpha, beta = residual_coefficients("deeploop", N * L)
            assert N * (N * L) * (beta / alpha) ** 2 == pytest.approx(1 / (16 * L))
    assert "0.02 beta (DeepLoop at N = 4: 0.0035" in " ".join(text.split())
    assert 0.02 * residual_coefficients("deeploop", 4)[1] == pytest.approx(0.0035, abs=5e-5)


@pytest.mark.parametrize("setting,message", [
    ("--check=bound", "unknown check 'bound'; choose one of coefficients, expand, kappa, step, norm"),
    ("--loops=0", "loops and n_layer must be >= 1, exponents > 0 and steps >= 0"),
    ("--exponents=0", "loops and n_layer must be >= 1, exponents > 0 and steps >= 0"),
    ("--loops=two", "loops must be ints, comma-separated, got 'two'"),
    ("--residual=preln_scaled", "residual must be deeploop, deepnorm, postln or preln"),
])
def test_bad_settings_are_one_line_errors(setting, message):
    r = run_script("lab/lesson.py", setting)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, (setting, r.stderr)
    assert r.stderr.startswith(f"error: {message}"), r.stderr
