"""--host without a network (on a real sshd: tests/slurm/test_remote.py): the remote command line is the user's,
every word quoted for the remote shell; a host that looks like an option is refused."""

from __future__ import annotations

import shlex

import click
import pytest

from trainstack._slurm.ssh import Remote, RemoteError
from trainstack.cli import main
from trainstack.cli.base import forwarded_args


def _args(*argv: str) -> list[str]:
    root = main.make_context("trainstack", list(argv), resilient_parsing=True)
    name, cmd, rest = main.resolve_command(root, list(argv))
    assert cmd is not None
    ctx = cmd.make_context(name, rest, parent=root)
    if isinstance(cmd, click.Group):
        sub, subcmd, rest2 = cmd.resolve_command(ctx, rest)
        ctx = subcmd.make_context(sub, rest2, parent=ctx)
    return forwarded_args(ctx)


def test_the_remote_command_line_is_the_users_without_host():
    assert _args("status", "--json", "--limit", "5", "--host", "c", "12") == ["status", "--json", "--limit", "5",
                                                                              "--", "12"]
    assert _args("logs", "--host", "c", "-f", "--rank", "2", "7") == ["logs", "--rank", "2", "-f", "7"]
    assert _args("status", "--host", "c") == ["status"]  # defaults stay the remote side's own
    assert _args("checkpoint", "inspect", "--best", "--host", "c", "runs/x") == ["checkpoint", "inspect", "--best",
                                                                                  "runs/x"]
    words = _args("submit", "--host", "c", "--cpu", "--nodes", "1", "--env", "A=1", "--env", "B=2", "--no-snapshot",
                  "--", "train.py", "--lr", "0.1")
    assert words[0] == "submit" and words[-4:] == ["--", "train.py", "--lr", "0.1"]
    assert "--cpu" in words and "--no-snapshot" in words and words.count("--env") == 2 and "--host" not in words


def test_every_word_reaches_the_remote_shell_quoted():
    remote = Remote("cluster")
    argv = remote.ssh(["trainstack", "logs", "1; rm -rf ~", "$(id)"])
    assert argv[-2] == "--" and shlex.split(argv[-1]) == ["trainstack", "logs", "1; rm -rf ~", "$(id)"]
    assert "BatchMode=yes" in argv and any(o.startswith("ControlPath=") for o in argv)


def test_a_host_that_looks_like_an_option_is_refused():
    with pytest.raises(RemoteError, match="is not a host"):
        Remote("-oProxyCommand=touch /tmp/x")
