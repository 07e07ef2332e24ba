"""A small validator for Apptainer definition files (spython alone accepts broken files).

    python scripts/defcheck.py apptainer.def     # exit 1 and one line per problem
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DefFile", "parse_def", "check_def"]

SECTIONS = {"arguments", "setup", "files", "environment", "post", "runscript", "startscript", "test", "labels",
            "help", "pre"}
BOOTSTRAPS = {"docker", "docker-daemon", "docker-archive", "localimage", "library", "oras", "shub", "debootstrap",
              "yum", "zypper", "busybox", "scratch"}
REQUIRED = ("post", "environment", "runscript", "test", "labels", "help")


@dataclass
class DefFile:
    header: dict[str, str] = field(default_factory=dict)
    sections: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def labels(self) -> dict[str, str]:
        out = {}
        for line in self.sections.get("labels", []):
            if line.strip() and not line.strip().startswith("#"):
                key, _, value = line.strip().partition(" ")
                out[key] = value.strip()
        return out

    @property
    def arguments(self) -> dict[str, str]:
        out = {}
        for line in self.sections.get("arguments", []):
            if "=" in line and not line.strip().startswith("#"):
                key, _, value = line.strip().partition("=")
                out[key.strip()] = value.strip()
        return out

    def body(self, section: str) -> list[str]:
        return [ln.strip() for ln in self.sections.get(section, []) if ln.strip() and not ln.strip().startswith("#")]


def parse_def(text: str) -> DefFile:
    d = DefFile()
    current: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^%(\w+)", line)
        if m:
            name = m.group(1)
            if name.startswith("app"):
                current = f"{name}:{line.split()[1] if len(line.split()) > 1 else ''}"
            elif name not in SECTIONS:
                d.problems.append(f"line {number}: unknown section %{name} (valid: {', '.join(sorted(SECTIONS))})")
                current = name
            else:
                if name in d.sections:
                    d.problems.append(f"line {number}: section %{name} appears twice")
                current = name
            d.sections.setdefault(current, [])
            continue
        if current is None:
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            key, sep, value = stripped.partition(":")
            if not sep:
                d.problems.append(f"line {number}: header line {stripped!r} is not 'Key: value'")
                continue
            d.header[key.strip().lower()] = value.strip()
        else:
            d.sections[current].append(line)
    return d


def check_def(text: str) -> DefFile:
    """Parse and validate: header, known and required sections, exec runscript, strict %post, NCCL %test."""
    d = parse_def(text)
    boot = d.header.get("bootstrap")
    if boot is None:
        d.problems.append("header: 'Bootstrap:' is missing")
    elif boot not in BOOTSTRAPS:
        d.problems.append(f"header: Bootstrap {boot!r} is not one of {', '.join(sorted(BOOTSTRAPS))}")
    if boot in ("docker", "docker-daemon", "localimage", "library", "oras") and not d.header.get("from"):
        d.problems.append("header: 'From:' is missing")
    for name in REQUIRED:
        if not d.body(name):
            d.problems.append(f"section %{name} is missing or empty")
    post = d.body("post")
    if post and not re.match(r"^set -e", post[0]):
        d.problems.append("%post must start with 'set -eu' (a failing step must fail the build)")
    runscript = d.body("runscript")
    if runscript and not any(line.startswith("exec ") for line in runscript):
        d.problems.append("%runscript must 'exec' the program so signals reach it")
    if d.body("test") and "is_nccl_available" not in " ".join(d.body("test")):
        d.problems.append("%test must assert torch.distributed.is_nccl_available()")
    for line in d.body("environment"):
        m = re.match(r"^export\s+(\w+)=(.*)$", line)
        if m and m.group(1) not in ("PATH", "LD_LIBRARY_PATH") and not m.group(2).strip('"').startswith(
                "${" + m.group(1) + ":-"):
            var = m.group(1)
            d.problems.append(f"%environment: {var} must use ${{{var}:-default}} so host/Slurm values win")
        if re.match(r"^export\s+NCCL_(SOCKET_IFNAME|IB_\w+|P2P_DISABLE|ALGO|PROTO)", line):
            d.problems.append(f"%environment: site-specific NCCL setting baked in: {line}")
    code = "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))
    for name in re.findall(r"{{\s*(\w+)\s*}}", code):
        if name not in d.arguments:
            d.problems.append(f"placeholder {{{{ {name} }}}} has no default in %arguments")
    return d


def main(argv: list[str] | None = None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or ["apptainer.def"]
    bad = 0
    for path in paths:
        d = check_def(Path(path).read_text())
        for problem in d.problems:
            print(f"{path}: {problem}")
        bad += len(d.problems)
    if not bad:
        print(f"{', '.join(paths)}: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
