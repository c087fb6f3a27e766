"""The container images, checked statically (no image can be built here: the base images come
from a registry this machine cannot reach). The Dockerfiles are parsed into stages and
instructions, and what matters is asserted on them: the user, the entrypoint, what is copied in
(no weights, except the demo family in the CPU image), the order of the installs, the labels,
and that the build context (.dockerignore) has what the COPYs need and nothing heavy besides."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy.conftest import ROOT

DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
UID = 10001


@dataclass
class Instruction:
    keyword: str
    """Upper-case instruction (RUN, COPY, ...)."""
    args: str
    """Everything after the keyword, continuation lines joined."""

    def flags_and_words(self) -> tuple[dict[str, str], list[str]]:
        """``--flag=value`` options and the remaining words (shell-split)."""
        words = shlex.split(self.args)
        flags = {}
        while words and words[0].startswith("--"):
            key, _, value = words.pop(0)[2:].partition("=")
            flags[key] = value
        return flags, words

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list), f"{self.keyword} is not in exec form: {self.args}"
        return value


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def index(self, keyword: str, pattern: str) -> int:
        """Position of the first ``keyword`` instruction whose args match ``pattern``."""
        for n, i in enumerate(self.instructions):
            if i.keyword == keyword and re.search(pattern, i.args):
                return n
        raise AssertionError(f"no {keyword} matching {pattern!r} in stage {self.name}")


@dataclass
class Dockerfile:
    args: dict[str, str]
    """ARG defaults (global and per stage)."""
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def resolve(self, text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.args.get(m.group(1), m.group(0)), text)


def parse(path: Path) -> Dockerfile:
    """Stages and instructions of a Dockerfile (comments dropped, continuations joined)."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: dangling line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args.setdefault(name, default.strip('"'))
            if not stages:
                continue
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
            continue
        assert stages, f"{path}: {keyword} before the first FROM"
        stages[-1].instructions.append(Instruction(keyword, rest))
    return Dockerfile(args, stages)


@pytest.fixture(params=sorted(DOCKERFILES))
def variant(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def dockerfile(variant: str) -> Dockerfile:
    return parse(DOCKERFILES[variant])


def base_image(df: Dockerfile, stage: Stage) -> str:
    """The registry image a stage starts from (following FROM <earlier stage>)."""
    base = df.resolve(stage.base)
    names = {s.name: s for s in df.stages if s.name}
    return base_image(df, names[base]) if base in names else base


def test_parser_reads_stages_and_instructions(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text('ARG BASE=python:3.11-slim\n# comment\nFROM ${BASE} AS one\nRUN a \\\n    && b\n'
                    'FROM one\nUSER 10001:10001\nENTRYPOINT ["spin"]\n')
    df = parse(path)
    assert [s.name for s in df.stages] == ["one", None]
    assert df.stages[0].instructions == [Instruction("RUN", "a  && b")]
    assert base_image(df, df.final) == "python:3.11-slim"
    assert df.final.instructions[-1].exec_form() == ["spin"]


def test_runs_as_numeric_non_root_user_before_entrypoint(dockerfile: Dockerfile) -> None:
    final = dockerfile.final
    users = final.all("USER")
    assert users, "the final stage sets no USER: the image would run as root"
    assert re.fullmatch(r"\d+(:\d+)?", users[-1].args), "USER must be numeric (runAsNonRoot checks it)"
    assert [int(x) for x in users[-1].args.split(":")] in ([UID], [UID, UID])
    last_user = max(n for n, i in enumerate(final.instructions) if i.keyword == "USER")
    assert last_user < final.index("ENTRYPOINT", "."), "USER must come before ENTRYPOINT"
    assert final.index("RUN", "useradd") < last_user
    useradd = final.instructions[final.index("RUN", "useradd")].args
    assert f"--uid {UID}" in useradd and f"--gid {UID}" in useradd and "--home-dir /home/spin" in useradd
    assert f"--gid {UID} spin" in final.instructions[final.index("RUN", "groupadd")].args
    assert f"-o {UID} -g {UID} /home/spin/.cache" in useradd, "the cache dir must be the user's"
    env = " ".join(i.args for i in final.all("ENV"))
    assert "HOME=/home/spin" in env and "XDG_CACHE_HOME=/home/spin/.cache" in env


def test_entrypoint_is_the_spin_cli(dockerfile: Dockerfile) -> None:
    final = dockerfile.final
    (entrypoint,) = final.all("ENTRYPOINT")
    assert entrypoint.exec_form() == ["spin"]
    assert list(PROJECT["scripts"]) == ["spin"]
    (cmd,) = final.all("CMD")
    assert cmd.exec_form()  # exec form: arguments of `spin`
    env = " ".join(i.args for i in final.all("ENV"))
    assert "PATH=/opt/venv/bin:" in env, "`spin` must be on PATH (the venv's bin)"


def test_multi_stage_builder_venv(dockerfile: Dockerfile) -> None:
    assert len(dockerfile.stages) >= 2
    builder = dockerfile.stage("builder")
    assert builder.index("RUN", r"-m venv /opt/venv") >= 0
    copies = [i.flags_and_words() for i in dockerfile.final.all("COPY")]
    assert ({"from": "builder"}, ["/opt/venv", "/opt/venv"]) in copies
    # Nothing is pip-installed in the runtime stage: it only copies the venv.
    assert not any("pip install" in i.args for i in dockerfile.final.all("RUN"))
    # The runtime's interpreter is the builder's (the venv links to it).
    assert base_image(dockerfile, builder) == base_image(dockerfile, dockerfile.final)


def test_torch_pinned_and_installed_before_the_project(variant: str, dockerfile: Dockerfile) -> None:
    builder = dockerfile.stage("builder")
    torch_at = builder.index("RUN", r"pip install .*torch==")
    torch_run = dockerfile.resolve(builder.instructions[torch_at].args)
    project_at = builder.index("RUN", r"pip install \.(\s|$)")
    assert torch_at < project_at, "torch must be installed before the project (or pip picks a build)"
    assert builder.index("COPY", "services") > torch_at, "the torch layer must not depend on sources"
    pinned = re.search(r"torch==([\w.+]+)", torch_run).group(1)
    makefile = re.search(r"^TORCH \?= torch==(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert pinned == makefile.group(1), "the images pin the torch of the Makefile"
    index = re.search(r"--index-url\s+\"?(\S+?)\"?(\s|$)", torch_run).group(1)
    if variant == "cpu":
        assert index == "https://download.pytorch.org/whl/cpu"
        assert "torch.version.cuda is None" in builder.instructions[project_at].args
    else:
        assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", index)
        assert "torch.version.cuda" in builder.instructions[project_at].args


def test_base_images(variant: str, dockerfile: Dockerfile) -> None:
    base = base_image(dockerfile, dockerfile.final)
    if variant == "cpu":
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    else:
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-\w+-ubuntu\d+\.\d+", base), base
        installs = " ".join(i.args for i in dockerfile.stage("python").all("RUN"))
        assert "python3.11 " in installs and "python3.11-venv" in installs
        assert "python3.11 -m venv /opt/venv" in dockerfile.stage("builder").instructions[
            dockerfile.stage("builder").index("RUN", "venv")].args
    assert PROJECT["requires-python"] == ">=3.11"


def test_oci_labels(dockerfile: Dockerfile) -> None:
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"',
                             " ".join(i.args for i in dockerfile.final.all("LABEL"))))
    assert {"title", "description", "source", "licenses", "version", "revision"} <= {
        k.rsplit(".", 1)[1] for k in labels}
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"]["text"]
    assert dockerfile.resolve(labels["org.opencontainers.image.version"]) == PROJECT["version"]


def context_copies(df: Dockerfile) -> list[tuple[str, str, str | None]]:
    """(stage, source, destination) of every COPY from the build context."""
    out = []
    for stage in df.stages:
        for i in stage.all("COPY"):
            flags, words = i.flags_and_words()
            if "from" not in flags:
                out += [(stage.name, src.rstrip("/"), words[-1]) for src in words[:-1]]
    return out


def test_copies_sources_and_no_weights(variant: str, dockerfile: Dockerfile) -> None:
    copies = context_copies(dockerfile)
    sources = {src for _, src, _ in copies}
    assert "." not in sources and "*" not in sources, "the whole context would carry weights"
    # What `pip install .` needs: the metadata and every package tree of pyproject's find.
    assert {"pyproject.toml", "README.md", "services", "loadgen"} <= sources
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    weights = {src for src in sources if src.startswith("models")}
    if variant == "cuda":
        assert not weights, "the CUDA image carries no weights"
    else:
        assert weights == {"models/demo"}, "the CPU image carries the demo family only"
        final_copies = [i.flags_and_words()[1] for i in dockerfile.final.all("COPY")]
        assert ["/opt/spin/models/demo", "/opt/spin/models/demo"] in final_copies
        env = " ".join(i.args for i in dockerfile.final.all("ENV"))
        assert "SPIN_FAMILY_DIR=/opt/spin/models/demo" in env
        # The safetensors files are committed owner-only; the image user must read them.
        models = dockerfile.stage(next(s for s, src, _ in copies if src == "models/demo"))
        assert models.index("RUN", r"chmod -R a\+rX") >= 0


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.strip().startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore matching (Go filepath.Match plus "**"), including parent dirs;
    a later "!pattern" re-includes."""
    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        for n in range(1, len(parts) + 1):
            prefix = "/".join(parts[:n])
            if fnmatch.fnmatchcase(prefix, pat) or (
                    pat.startswith("**/") and fnmatch.fnmatchcase(parts[n - 1], pat[3:])):
                result = not negate
                break
    return result


def test_dockerignore_matcher() -> None:
    patterns = [".venv", "**/__pycache__", "models/*/.*.partial", "build"]
    assert ignored(".venv/bin/python", patterns) and ignored("services/spin/__pycache__/x.pyc", patterns)
    assert ignored("models/demo/.target.partial/a", patterns) and ignored("build", patterns)
    assert not ignored("services/spin/cli.py", patterns) and not ignored("models/demo/target", patterns)


def test_dockerignore_keeps_what_the_copies_need_and_drops_the_rest() -> None:
    patterns = dockerignore()
    for must in (".venv", "build", ".git", ".pytest_cache", "services/spin/__pycache__/a.pyc",
                 "tests/deploy/conftest.py", "spin_serving.egg-info/PKG-INFO", "helm/spin/Chart.yaml"):
        assert ignored(must, patterns), f"{must} would be sent to the builder"
    for df in (parse(p) for p in DOCKERFILES.values()):
        for _, src, _ in context_copies(df):
            files = [src] if (ROOT / src).is_file() else [
                str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*") if p.is_file()
                and "__pycache__" not in p.parts]
            assert files, src
            for f in files:
                assert not ignored(f, patterns), f"{f} is needed by a COPY but .dockerignore drops it"
