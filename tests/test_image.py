"""The Dockerfile's images, built and run: its pins resolve for every target, and the CPU image is built
without a Docker daemon and run.

The pins (no network, no container engine): each target's `pip install` commands, with the stage's
ARG defaults, against the metadata of the torch wheel it installs (read live from the index the
command names when that answers, else as recorded in tests/fixtures/torch_requires.json) and
pyproject.toml's requirements, markers evaluated for the target (Linux x86_64, the Python of its
base image): a version that one requirement pins must satisfy every other requirement of the same
package (torch pins its own Triton).

The image (root, Debian's buildah, podman, runc and debootstrap, which `make test` installs where
apt-get runs as root; skipped naming the missing tool otherwise): stand-ins for the base images
(debootstrap's Debian 12 with Python 3.11 in /usr/local for python:3.11-slim, Ubuntu 24.04 for
nvidia/cuda:12.8.1-runtime-ubuntu24.04) are made once, kept in the cache folder
(V4SERVE_IMAGE_CACHE, default ~/.cache/v4serve-image, with buildah's storage and its layer cache)
and stored under the Dockerfile's own FROM names. The CPU target is built from the Dockerfile
unchanged by `buildah bud --isolation chroot --format docker` (storage driver overlay where this
machine mounts it, else vfs), torch's CPU wheel in a folder mounted for the build (TORCH_SPEC), then
run by podman as a user would: the HEALTHCHECK as the image config keeps it, run as the engine runs
it (/health), one chat completion, the user and group, the writable store folder, no Triton, and a
clean stop on SIGTERM. The GPU target is built up to its torch install (its apt packages, venv and
Python), and the pins check is repeated with that Python's own marker environment.

Time (2 cores, overlay): the first run makes the bases and builds everything (about 6 minutes, the two
image tests side by side); later runs reuse the bases and the torch layer (about a minute when the
package changed)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.daemon import PATIENCE, ROOT

DOCKERFILE = ROOT / "Dockerfile"
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "torch_requires.json").read_text())
PYPI = "https://pypi.org/simple"
# The python3 each distribution's apt installs (a base image that installs its own Python names it in
# its tag, as python:3.11-slim does). The GPU image test checks Ubuntu 24.04's against its stand-in.
DISTRO_PYTHON = {"ubuntu24.04": "3.12.3", "ubuntu22.04": "3.10.12", "bookworm": "3.11.2"}


# ---- the pins -------------------------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    base: str
    instructions: list[dict] = field(default_factory=list)  # dockerfile-parse's, comments left out


def stages(text: str | None = None) -> dict[str, Stage]:
    """The Dockerfile's stages by name (or by index when unnamed), in order."""
    parser = DockerfileParser(str(DOCKERFILE)) if text is None else DockerfileParser(fileobj=io.BytesIO(text.encode()))
    out: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        if item["instruction"] == "FROM":
            words = item["value"].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(out))
            current = out[name] = Stage(name, words[0])
        elif current is not None and item["instruction"] != "COMMENT":
            current.instructions.append(item)
    return out


def stage_args(stage: Stage, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The stage's ARG values: their defaults, or the build arguments given."""
    args: dict[str, str] = {}
    for item in stage.instructions:
        if item["instruction"] == "ARG":
            for word in shlex.split(item["value"]):
                name, _, default = word.partition("=")
                args[name] = default
    return {**args, **{k: v for k, v in (overrides or {}).items() if k in args}}


@dataclass
class PipInstall:
    requirements: list[Requirement]
    index_url: str  # where torch and the rest come from (PyPI unless --index-url names another)
    wheel: bool  # installs the package's own wheel (/wheels/*.whl from the wheel stage)
    line: int


def pip_installs(stage: Stage, args: dict[str, str]) -> list[PipInstall]:
    """Each `pip install` a RUN of the stage runs, its ARGs substituted as the shell does."""
    out = []
    for item in stage.instructions:
        if item["instruction"] != "RUN":
            continue
        command = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)),
                         item["value"])
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens, parts = list(lexer), [[]]
        for token in tokens:  # the simple commands: split at && ; || | and redirections
            if set(token) <= set("&;|<>()"):
                parts.append([])
            else:
                parts[-1].append(token)
        for words in parts:
            at = next((i for i, w in enumerate(words[:3]) if w.rsplit("/", 1)[-1] in ("pip", "pip3")), None)
            if at is None or words[at + 1:at + 2] != ["install"]:
                continue
            words = words[at + 2:]
            index, requirements, wheel, skip = PYPI, [], False, False
            for i, word in enumerate(words):
                if skip:
                    skip = False
                elif word in ("--index-url", "-i"):
                    index, skip = words[i + 1].rstrip("/"), True
                elif word in ("--extra-index-url", "--find-links", "-f", "-r", "--requirement", "-c",
                              "--constraint", "--report", "--target", "-t", "--python-version", "--platform"):
                    skip = True  # -r: a file written during the build (a subset of the wheel's requirements)
                elif word.startswith("-"):
                    continue
                elif word.endswith(".whl") and word.startswith("/wheels/"):
                    wheel = True
                else:
                    requirements.append(Requirement(word))
            out.append(PipInstall(requirements, index, wheel, item["startline"] + 1))
    return out


def target_python(stage: Stage) -> str:
    """The Python version the stage's pip installs for: its base image's, or its distribution's python3."""
    name, _, tag = stage.base.partition(":")
    if name.rsplit("/", 1)[-1] == "python":
        found = re.match(r"\d+\.\d+(\.\d+)?", tag)
        assert found, stage.base
        return found.group(0) if found.group(1) else found.group(0) + ".0"
    distro = next((d for d in DISTRO_PYTHON if tag.endswith(d) or f"-{d}" in tag), None)
    assert distro, f"which Python does {stage.base} install? Add its distribution to DISTRO_PYTHON"
    return DISTRO_PYTHON[distro]


def marker_environment(python: str) -> dict[str, str]:
    """The markers pip evaluates on Linux x86_64 under CPython `python` (X.Y.Z)."""
    return {**default_environment(), "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
            "implementation_version": python, "platform_release": "", "platform_version": ""}


def wheel_pattern(version: str, python: str) -> re.Pattern:
    tag = "cp" + "".join(python.split(".")[:2])
    return re.compile(rf"torch-{re.escape(version)}(\+\w+)?-{tag}-{tag}-manylinux_2_\d+_x86_64\.whl$")


@functools.cache
def live_torch_metadata(index: str, version: str, python: str) -> dict | None:
    """Requires-Python and Requires-Dist of the torch wheel `index` serves (PEP 658 metadata), or None
    when the index does not answer within seconds."""
    try:
        page = urllib.request.urlopen(f"{index}/torch/", timeout=10).read().decode()
        pattern = wheel_pattern(version, python)
        hrefs = [h for h in re.findall(r'href="([^"#]+)', page) if pattern.search(h.rsplit("/", 1)[-1])]
        if not hrefs:
            return None
        href = urllib.request.urljoin(f"{index}/torch/", hrefs[0])
        text = urllib.request.urlopen(href + ".metadata", timeout=30).read().decode()
    except OSError:
        return None
    lines = [line.split(":", 1) for line in text.split("\n\n", 1)[0].splitlines() if ":" in line]
    return {"source": f"{href.rsplit('/', 1)[-1]} from {index}",
            "requires_python": next((v.strip() for k, v in lines if k == "Requires-Python"), None),
            "requires_dist": [v.strip() for k, v in lines if k == "Requires-Dist"]}


def torch_metadata(index: str, version: str, python: str, live: bool = True) -> dict:
    """torch `version`'s metadata for `python` on Linux x86_64 from `index`: live when it answers, else as
    recorded; for a CUDA index recorded nowhere, PyPI's build of the same release (PyPI's Linux x86_64
    torch is a CUDA build, and every CUDA build of a release pins the same Triton)."""
    if live and (found := live_torch_metadata(index, version, python)):
        return found
    pattern = wheel_pattern(version, python)
    candidates = [(index, "")]
    if re.search(r"/whl/cu\d+$", index):
        candidates.append((PYPI, f" (recorded; {index} is not, and its CUDA builds pin what PyPI's does)"))
    for where, note in candidates:
        for name, meta in RECORDED.get(where, {}).items():
            if pattern.search(name):
                return {**meta, "source": f"{name} from {where}" + (note or " (recorded)")}
    pytest.fail(f"no metadata for torch {version} (Python {python}) from {index}: {index} did not answer and "
                f"tests/fixtures/torch_requires.json has no record of it")


def pyproject_requirements() -> tuple[str, list[Requirement]]:
    """pyproject.toml's requires-python and dependencies (read as text: tomllib is Python 3.11's)."""
    text = (ROOT / "pyproject.toml").read_text()
    requires_python = re.search(r'^requires-python = "([^"]+)"', text, re.M).group(1)
    block = re.search(r"^dependencies = \[\n(.*?)^\]", text, re.M | re.S).group(1)
    lines = (line.split("#", 1)[0].strip().rstrip(",") for line in block.splitlines())
    return requires_python, [Requirement(json.loads(line)) for line in lines if line]


def pin_problems(target: str, text: str | None = None, build_args: dict[str, str] | None = None,
                 environment: dict[str, str] | None = None, live: bool = True) -> list[str]:
    """Why the target's pip installs cannot resolve together (empty: they can). Every requirement on a
    package is gathered (the explicit ones, torch's own and the package's from pyproject.toml); each
    version one of them pins must satisfy all the others."""
    stage = stages(text)[target]
    python = (environment or {}).get("python_full_version") or target_python(stage)
    env = environment or marker_environment(python)
    wanted: dict[str, list[tuple[Requirement, str]]] = {}
    problems = []

    def add(requirement: Requirement, origin: str) -> None:
        if requirement.marker is None or requirement.marker.evaluate({**env, "extra": ""}):
            wanted.setdefault(canonicalize_name(requirement.name), []).append((requirement, origin))

    installs = pip_installs(stage, stage_args(stage, build_args))
    assert installs, f"the {target} stage installs nothing with pip"
    for install in installs:
        for requirement in install.requirements:
            add(requirement, f"Dockerfile line {install.line}")
            pins = [s.version for s in requirement.specifier if s.operator in ("==", "===")]
            if canonicalize_name(requirement.name) == "torch" and pins:
                meta = torch_metadata(install.index_url, pins[0], python, live)
                if meta["requires_python"] and python not in SpecifierSet(meta["requires_python"]):
                    problems.append(f"torch {pins[0]} ({meta['source']}) requires Python {meta['requires_python']}, "
                                    f"the {target} target has {python}")
                for line in meta["requires_dist"]:
                    add(Requirement(line), f"torch {pins[0]}'s Requires-Dist: {meta['source']}")
        if install.wheel:
            requires_python, requirements = pyproject_requirements()
            if python not in SpecifierSet(requires_python):
                problems.append(f"pyproject.toml requires Python {requires_python}, the {target} target has {python}")
            for requirement in requirements:
                add(requirement, "pyproject.toml")
    for name, requirements in wanted.items():
        for i, (one, one_by) in enumerate(requirements):
            for other, other_by in requirements[i + 1:]:
                pins = [s.version for r in (one, other) for s in r.specifier if s.operator in ("==", "===")]
                if any(not r.specifier.contains(v, prereleases=True) for r in (one, other) for v in pins):
                    problems.append(f"{name}: {one} ({one_by}) against {other} ({other_by})")
    return problems


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_each_targets_pins_resolve(target: str) -> None:
    assert pin_problems(target) == []


def test_the_pin_check_finds_a_triton_that_torch_does_not_pin() -> None:
    """The check itself, on the GPU stage as it once was: Triton 3.9 beside a torch that pins 3.7.1."""
    old = """FROM python:3.11-slim AS wheel
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS gpu
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
ARG TRITON_SPEC="triton==3.9.0"
RUN pip install --no-cache-dir ${TORCH_SPEC} ${TRITON_SPEC} && pip install --no-cache-dir /wheels/*.whl
"""
    problems = pin_problems("gpu", old, live=False)
    assert len(problems) == 1 and problems[0].startswith("triton: triton==3.7.1;"), problems
    assert "against triton==3.9.0 (Dockerfile line 5)" in problems[0], problems
    assert pin_problems("gpu", old, {"TRITON_SPEC": "triton==3.7.1"}, live=False) == []
    assert target_python(stages(old)["gpu"]) == "3.12.3" and target_python(stages(old)["wheel"]) == "3.11.0"


# ---- the image ------------------------------------------------------------------------------------------

CACHE = Path(os.environ.get("V4SERVE_IMAGE_CACHE") or Path.home() / ".cache" / "v4serve-image")
TOOLS = ("buildah", "podman", "runc", "debootstrap")
IMAGE = "localhost/v4serve-test"
# The stand-ins: the FROM name, the distribution debootstrap makes it from, and what more it does.
DEBIAN, UBUNTU = "http://deb.debian.org/debian", "http://archive.ubuntu.com/ubuntu"


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


needs_tools = pytest.mark.skipif(
    bool(missing_tools()) or os.geteuid() != 0,
    reason=f"{', '.join(missing_tools()) or 'root'} missing: the image is built by root with Debian's "
           f"{', '.join(TOOLS)}, which `make test` installs where apt-get runs as root",
)


@functools.cache
def storage_driver() -> str:
    """overlay where this machine can mount it (a layer is then a folder of changes), else vfs (each
    layer a full copy: slower, and works anywhere)."""
    probe = CACHE / "overlay-probe"
    shutil.rmtree(probe, ignore_errors=True)
    for d in ("lower", "upper", "work", "merged"):
        (probe / d).mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={probe}/lower,upperdir="
                              f"{probe}/upper,workdir={probe}/work", str(probe / "merged")], capture_output=True)
    if mounted.returncode == 0:
        subprocess.run(["umount", str(probe / "merged")], check=True)
    shutil.rmtree(probe, ignore_errors=True)
    return "overlay" if mounted.returncode == 0 else "vfs"


def storage() -> list[str]:
    driver = storage_driver()
    return ["--root", str(CACHE / f"storage-{driver}"), "--runroot", str(CACHE / f"run-{driver}"),
            "--storage-driver", driver]


def sh(*args: str | Path, timeout: float = PATIENCE, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check:
        assert done.returncode == 0, f"{shlex.join(map(str, args))} exited {done.returncode}:\n" \
                                     f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def buildah(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    return sh("buildah", *storage(), *args, **kwargs)


def podman(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    # No systemd, no network stack of its own (the host's): podman as a plain process tree.
    return sh("podman", *storage(), "--cgroup-manager", "cgroupfs", "--events-backend", "file",
              "--runtime", "runc", *args, **kwargs)


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One test process at a time makes a base or builds (two `make test` runs may share the cache)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def has_image(name: str) -> bool:
    return buildah("inspect", "--type", "image", name, check=False).returncode == 0


# The apt sources of Ubuntu's own image (ubuntu:24.04, which nvidia/cuda's images are built on): all
# four components, with updates, backports and security.
UBUNTU_SOURCES = """Types: deb
URIs: http://archive.ubuntu.com/ubuntu/
Suites: {suite} {suite}-updates {suite}-backports
Components: main universe restricted multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg

Types: deb
URIs: http://security.ubuntu.com/ubuntu/
Suites: {suite}-security
Components: main universe restricted multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg
"""
# Bumped when a recipe below changes: the stand-ins kept in the cache are made again.
RECIPE = 2


def stand_in(name: str, suite: str, mirror: str, script: str | None = None, python_in_usr_local: bool = False) -> None:
    """Store a debootstrap-made image under `name` (once: its root file system is kept as a tarball)."""
    recipe = f"{suite}-{RECIPE}"
    # What this machine trusts, the stand-in trusts (pip too): a machine whose HTTPS goes through a proxy
    # of its own has that proxy's certificate authority in its bundle.
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    trusted = hashlib.sha256(bundle.read_bytes()).hexdigest()[:12] if bundle.exists() else "none"
    label = f"{recipe}-{trusted}"
    with locked("bases"):
        found = buildah("inspect", "--type", "image", name, check=False)
        if found.returncode == 0:
            if json.loads(found.stdout)["Docker"]["config"].get("Labels", {}).get("v4serve.stand-in") == label:
                return
            buildah("rmi", "--force", name)
        tarball = CACHE / "bases" / f"{recipe}.tar"
        if not tarball.exists():
            rootfs = CACHE / "bases" / suite
            shutil.rmtree(rootfs, ignore_errors=True)
            rootfs.parent.mkdir(parents=True, exist_ok=True)
            ubuntu = "ubuntu" in mirror
            # Ubuntu's archive key is not in Debian: this image is a stand-in, never shipped.
            sh("debootstrap", "--variant=minbase", *(["--include=python3,python3-venv"] if python_in_usr_local else []),
               *(["--no-check-gpg"] if ubuntu else []), suite, rootfs, mirror, *([script] if script else []),
               timeout=1200)
            if python_in_usr_local:  # as python:3.11-slim: python and pip in /usr/local/bin, installing as root
                sh("chroot", rootfs, "/usr/bin/python3", "-m", "venv", "/usr/local")
            if ubuntu:
                (rootfs / "etc/apt/sources.list").unlink()
                (rootfs / "etc/apt/sources.list.d/ubuntu.sources").write_text(UBUNTU_SOURCES.format(suite=suite))
            for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for path in (rootfs / junk).glob("*"):
                    if path.is_file():
                        path.unlink()
            sh("tar", "-C", rootfs, "-cf", f"{tarball}.part", ".", timeout=600)
            os.replace(f"{tarball}.part", tarball)
            shutil.rmtree(rootfs)
        container = buildah("from", "scratch").stdout.strip()
        try:
            buildah("add", container, tarball, "/", timeout=600)
            if bundle.exists():
                pip_conf = CACHE / "bases" / "pip.conf"
                pip_conf.write_text(f"[global]\ncert = {bundle}\n")
                buildah("copy", container, bundle, str(bundle))
                buildah("copy", container, pip_conf, "/etc/pip.conf")
            buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "--env", "LANG=C.UTF-8", "--cmd", "bash", "--os", "linux", "--arch", "amd64",
                    "--label", f"v4serve.stand-in={label}", container)
            buildah("commit", "--format", "docker", container, name, timeout=600)
        finally:
            buildah("rm", container, check=False)


def reachable(*urls: str) -> None:
    """Skip, naming them, when the package mirrors a build needs do not answer."""
    down = []
    for url in urls:
        try:
            urllib.request.urlopen(url, timeout=20).close()
        except OSError as exc:
            down.append(f"{url} ({exc})")
    if down:
        pytest.skip(f"the image is built from packages this machine cannot reach: {', '.join(down)}")


def bases(*names: str) -> dict[str, str]:
    """The base images of the Dockerfile's stages `names`, each with a stand-in stored under its name."""
    out = {}
    for stage in (s for s in stages().values() if s.name in names):
        base = stage.base if "/" in stage.base.split(":")[0] else f"docker.io/library/{stage.base}"
        base = base if base.count("/") >= 2 else f"docker.io/{base}"
        out[stage.name] = base
        if "/python:" in base:
            stand_in(base, "bookworm", DEBIAN, python_in_usr_local=True)
        elif base.endswith("ubuntu24.04"):
            stand_in(base, "noble", UBUNTU, "/usr/share/debootstrap/scripts/gutsy")
        else:
            pytest.fail(f"no stand-in for the base image {stage.base}: teach tests/test_image.py to make one")
    return out


def torch_cpu_wheel(requirement: Requirement, index: str) -> Path:
    """torch's CPU wheel for Python 3.11 (the one TORCH_SPEC names: its index's local version label), once."""
    version = next(s.version for s in requirement.specifier if s.operator == "==")
    local = index.rstrip("/").rsplit("/", 1)[-1]
    wheels = CACHE / "wheels"
    pattern = wheel_pattern(f"{version}+{local}", "3.11.0")
    if not any(pattern.search(w.name) for w in wheels.glob("*.whl")):
        wheels.mkdir(parents=True, exist_ok=True)
        done = sh(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                  "3.11", "--platform", "manylinux_2_28_x86_64", "--retries", "1", "--timeout", "30",
                  "--extra-index-url", index, "--dest", wheels, f"torch=={version}+{local}", check=False, timeout=1200)
        if not any(pattern.search(w.name) for w in wheels.glob("*.whl")):
            pytest.skip(f"torch {version}+{local} could not be downloaded (from {index} or pip's own indexes): "
                        f"{done.stderr.strip().splitlines()[-1:]}")
    return wheels


def prune() -> None:
    """Drop the layers no kept image is built on (each build of changed code leaves some)."""
    for _ in range(20):
        if not buildah("rmi", "--prune", check=False).stdout.strip():
            return


def image_config(name: str) -> dict:
    return json.loads(buildah("inspect", "--type", "image", name).stdout)


@needs_tools
def test_cpu_image_builds_runs_and_stops() -> None:
    reachable(f"{DEBIAN}/dists/bookworm/Release", f"{PYPI}/pip/")
    bases("wheel", "cpu")
    stage = stages()["cpu"]
    torch_spec = stage_args(stage)["TORCH_SPEC"].split()
    index = torch_spec[torch_spec.index("--index-url") + 1]
    torch = Requirement(torch_spec[0])
    wheels = torch_cpu_wheel(torch, index)
    # pip finds the CPU wheel in a folder mounted for the build, torch's dependencies and the rest on PyPI.
    spec = f"{torch}+{index.rstrip('/').rsplit('/', 1)[-1]} --find-links /run/torch-wheels"
    with locked("build"):
        started = time.monotonic()
        buildah("bud", "--isolation", "chroot", "--format", "docker", "--layers", "--pull=never", "--target", "cpu",
                "--volume", f"{wheels}:/run/torch-wheels:ro", "--build-arg", f"TORCH_SPEC={spec}",
                "-t", f"{IMAGE}:cpu", "-f", DOCKERFILE, ROOT, timeout=1800)
        build_s = time.monotonic() - started
        prune()
    config = image_config(f"{IMAGE}:cpu")
    docker = config["Docker"]["config"]
    healthcheck = next(i["value"] for i in stage.instructions if i["instruction"] == "HEALTHCHECK")
    test = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert docker["Healthcheck"]["Test"] == ["CMD", *test], docker.get("Healthcheck")
    assert docker["Healthcheck"]["StartPeriod"] >= 600 * 10**9
    assert docker["User"] == "v4serve" and docker["Entrypoint"] == ["v4serve", "serve"] and not docker.get("Cmd")
    assert docker["StopSignal"] == "SIGTERM" and set(docker["Volumes"]) == {"/models", "/var/cache/v4serve"}

    name = f"v4serve-test-{os.getpid()}"
    podman("rm", "--force", "--ignore", "--volumes", name, check=False)
    # Run as a user would (no arguments: the tiny model on port 8000, the store in the image's volume), in a
    # network of its own (a loopback only: port 8000 of this machine may be taken), so every request is made
    # inside, as the HEALTHCHECK's is. The engine's health checks run from systemd timers, which this machine
    # may not have: the test runs the command itself. podman's default open-file and process limits are
    # above what a container without CAP_SYS_RESOURCE may set: these are below.
    podman("run", "--detach", "--name", name, "--network", "none", "--no-healthcheck", "--ulimit", "nofile=4096:4096",
           "--ulimit", "nproc=4096:4096", f"{IMAGE}:cpu", timeout=600)
    try:
        def inside(*command: str) -> str:
            return podman("exec", name, *command).stdout.strip()

        def logs() -> str:
            done = podman("logs", name)
            return done.stdout + done.stderr

        started = time.monotonic()
        while not re.search(r"serving \S+ at http://\S+:8000/v1 ", logs()):
            state = json.loads(podman("inspect", name).stdout)[0]["State"]
            assert state["Running"], f"the container exited {state['ExitCode']}:\n{logs()[-4000:]}"
            assert time.monotonic() - started < PATIENCE, f"no daemon after {PATIENCE:.0f} s:\n{logs()[-4000:]}"
            time.sleep(0.5)
        inside(*test)  # the HEALTHCHECK command, as the engine runs it: /health answers 200
        reply = json.loads(inside("python", "-c", CHAT))
        assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] >= 1, reply
        assert inside("id", "-u") == "10001" and inside("id", "-g") == "10001" and inside("id", "-gn") == "v4serve"
        assert inside("stat", "-c", "%u:%g", "/var/cache/v4serve") == "10001:10001"
        assert inside("ls", "-A", "/var/cache/v4serve"), "the daemon wrote nothing to its store folder"
        inside("sh", "-c", "touch /var/cache/v4serve/.probe /home/v4serve/.probe && rm /var/cache/v4serve/.probe")
        assert inside("python", "-c", "import importlib.util as u; print(u.find_spec('triton'))") == "None"
        assert inside("python", "-c", "import torch; print(torch.__version__)").endswith("+cpu")

        started = time.monotonic()
        podman("stop", "--time", "30", name, timeout=120)  # SIGTERM, the image's STOPSIGNAL
        stop_s = time.monotonic() - started
        state = json.loads(podman("inspect", name).stdout)[0]["State"]
        assert state["ExitCode"] == 0 and stop_s < 20, (state["ExitCode"], stop_s, logs()[-3000:])
        assert "shutting down: running requests have 30 s to finish" in logs()
        assert "Application shutdown complete" in logs()
    finally:
        podman("rm", "--force", "--ignore", "--volumes", name, check=False)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", f"{IMAGE}:cpu").stdout)
    print(f"CPU image ({storage_driver()}): built in {build_s:.0f} s, {size / 1e9:.2f} GB, stopped in {stop_s:.1f} s")


# One chat completion from inside the container, printed as JSON.
CHAT = """import json, urllib.request
models = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models", timeout=300))
body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
request = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=300).read().decode())
"""


@needs_tools
def test_gpu_target_builds_up_to_torch() -> None:
    """The GPU stage on a stand-in of its base, up to its torch install (a CUDA torch needs CUDA's index
    and GPUs): its apt packages, its venv first on PATH, and its Python's own markers in the pins check."""
    reachable(f"{UBUNTU}/dists/noble/Release")
    base = bases("gpu")["gpu"]
    stage = stages()["gpu"]
    lines = DOCKERFILE.read_text().splitlines()
    first_pip = next(i for i in stage.instructions if i["instruction"] == "RUN" and "pip install" in i["value"])
    start = next(i for i in DockerfileParser(str(DOCKERFILE)).structure
                 if i["instruction"] == "FROM" and i["value"].endswith(" AS gpu"))["startline"]
    containerfile = CACHE / "Containerfile.gpu"
    with locked("build"):
        containerfile.write_text("\n".join(lines[start:first_pip["startline"]]) + "\n")
        buildah("bud", "--isolation", "chroot", "--format", "docker", "--layers", "--pull=never",
                "-t", f"{IMAGE}:gpu-base", "-f", containerfile, ROOT, timeout=1800)
        prune()
    container = buildah("from", f"{IMAGE}:gpu-base").stdout.strip()
    try:
        def inside(*command: str) -> str:
            return buildah("run", "--isolation", "chroot", container, "--", *command).stdout.strip()

        environment = json.loads(inside("python", "-c", "import json; from pip._vendor.packaging.markers import "
                                                        "default_environment as d; print(json.dumps(d()))"))
        assert inside("sh", "-c", "command -v python; command -v pip") == "/opt/venv/bin/python\n/opt/venv/bin/pip"
        assert environment["python_full_version"] == target_python(stage), environment
        inside("sh", "-c", "gcc --version && test -f \"$(python -c 'import sysconfig; "
                           "print(sysconfig.get_paths()[\"include\"])')/Python.h\"")
        assert pin_problems("gpu", environment=environment) == []
    finally:
        buildah("rm", container, check=False)
    assert base.endswith("ubuntu24.04")
