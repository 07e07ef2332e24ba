"""Every program form users type after `--`, and the ambiguous ones refused with the fix."""

from __future__ import annotations

import pytest

from trainstack._slurm.program import parse_program
from trainstack.errors import ConfigError


@pytest.mark.parametrize("words, kind, argv", [
    (["train.py", "--lr", "1"], "script", ("train.py", "--lr", "1")),
    (["python", "train.py", "--lr", "1"], "script", ("train.py", "--lr", "1")),
    (["python3", "-u", "train.py"], "script", ("train.py",)),
    (["/opt/venv/bin/python3.11", "-W", "ignore", "-u", "train.py", "-x"], "script", ("train.py", "-x")),
    (["-m", "pkg.train", "--lr", "1"], "module", ("pkg.train", "--lr", "1")),
    (["python", "-m", "pkg.train"], "module", ("pkg.train",)),
    (["./run.sh", "a b"], "exec", ("./run.sh", "a b")),
    (["bash", "run.sh"], "exec", ("bash", "run.sh")),
    (["/usr/bin/env", "X=1", "train"], "exec", ("/usr/bin/env", "X=1", "train")),
    (["python", "train"], "script", ("train",)),  # the user said it is Python
    (["mypython", "train.py"], "exec", ("mypython", "train.py")),  # found on PATH (is_executable says so)
])
def test_forms(words, kind, argv):
    program = parse_program(words, "python3", is_executable=lambda w: w == "mypython")
    assert (program.kind, program.argv) == (kind, argv)


@pytest.mark.parametrize("words, needle", [
    ([], "no program given"), ([""], "no program given"), (["python"], "names an interpreter but no script"),
    (["python", "-c", "print(1)"], "put the code in a file"), (["-m"], "-m needs a module name"),
    (["--epochs", "3"], "looks like an option"), (["train"], "-- train.py or -- python train"),
])
def test_ambiguous_or_empty_programs_are_refused(words, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_program(words, "python3", is_executable=lambda w: False)


def test_the_interpreter_named_by_python_is_recognised():
    assert parse_program(["py", "train.py"], "py").argv == ("train.py",)
