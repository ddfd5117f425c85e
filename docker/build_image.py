"""Build fleetrl's container image (docker/Dockerfile) with the OCI builder this machine has.

`make image` runs it. In order:

1. the builder: docker where its daemon answers, else podman, else buildah (``--builder``);
2. the base: the Dockerfile's Debian image where it is present or can be pulled; where it
   cannot (a machine that reaches only package registries), a Debian root filesystem made
   from Debian's packages by ``mmdebstrap``, kept in the cache folder and imported as
   ``localhost/fleetrl-base:bookworm``;
3. the build context (``<cache>/context``): fleetrl's wheel built from this checkout,
   requirements.txt (pyproject's dependencies and the chosen extras, after the pins given),
   a copy of configs/, and pip-ca.crt: the CA bundle this machine's pip is told to trust
   (``PIP_CERT`` or pip's ``cert`` setting, as behind a TLS-inspecting proxy), or empty;
4. the ``deps`` stage (the gigabytes: torch, SGLang, Ray), tagged by a hash of what it is
   made from and built only when no image of that tag exists, so a change to fleetrl's own
   code rebuilds only the last, small step;
5. the image itself on top of it.

Each decision is one printed line. A missing builder or mmdebstrap is one line and exit 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
FALLBACK_BASE = "localhost/fleetrl-base:bookworm"
DEBIAN_SUITE = "bookworm"  # Debian 12: python3 is 3.11


class BuildError(RuntimeError):
    """A step that cannot go on; main prints it as one line and exits 2."""


@dataclass(frozen=True)
class Builder:
    """An OCI builder's command line: docker, podman or buildah share the verbs used here."""

    name: str

    def build_cmd(self) -> list[str]:
        cmd = [self.name, "build"]
        if self.name == "buildah" and "BUILDAH_ISOLATION" not in os.environ:
            # the default (an OCI runtime) needs cgroups a sandboxed host may not give;
            # chroot isolation runs RUN steps with no runtime at all
            cmd += ["--isolation", "chroot"]
        return cmd

    def has_image(self, ref: str) -> bool:
        verb = ["inspect", "--type", "image"] if self.name == "buildah" else ["image", "inspect"]
        return _quiet([self.name, *verb, ref])

    def pull(self, ref: str) -> bool:
        return _quiet([self.name, "pull", ref], timeout=600)


def _quiet(cmd: list[str], timeout: float = 120) -> bool:
    try:
        result = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def find_builder(choice: str) -> Builder:
    """The builder asked for, or the first that works: docker (its daemon must answer),
    podman, buildah."""
    names = ["docker", "podman", "buildah"] if choice == "auto" else [choice]
    for name in names:
        if shutil.which(name) is None:
            continue
        if name == "docker" and not _quiet(["docker", "info"], timeout=30):
            print("image: docker is installed but its daemon does not answer; trying the others")
            continue
        return Builder(name)
    raise BuildError(
        f"no OCI builder found ({', '.join(names)}): install buildah or podman "
        "(apt-get install buildah) or start docker"
    )


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def requirements_text(extras: list[str], pins: list[str]) -> str:
    """The deps stage's requirements: the pins first, then pyproject's dependencies and
    those of each extra named."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise BuildError(f"--extras {','.join(unknown)}: pyproject.toml has no such extra")
    lines = [*pins, *project["dependencies"]]
    for extra in extras:
        lines += optional[extra]
    return "\n".join(lines) + "\n"


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if match is None:
        raise BuildError(f"{DOCKERFILE}: no `ARG {name}=...` line")
    return match.group(1)


def deps_stage_text() -> str:
    """The Dockerfile up to the final stage: what the deps image is built from."""
    text = DOCKERFILE.read_text()
    return text[: text.index("FROM ${DEPS}")]


def make_rootfs(cache: Path) -> Path:
    """A Debian root filesystem from Debian's packages (kept: later builds reuse it)."""
    tarball = cache / f"debian-{DEBIAN_SUITE}-rootfs.tar"
    if tarball.exists():
        print(f"image: reusing the Debian root filesystem {tarball}")
        return tarball
    if shutil.which("mmdebstrap") is None:
        raise BuildError(
            "the base image cannot be pulled and mmdebstrap is missing to make one from "
            "Debian's packages: apt-get install mmdebstrap, or pass --base IMAGE"
        )
    print(f"image: making a Debian {DEBIAN_SUITE} root filesystem with mmdebstrap")
    partial = tarball.with_suffix(".partial.tar")
    subprocess.run(
        ["mmdebstrap", "--quiet", "--variant=minbase", DEBIAN_SUITE, str(partial)], check=True
    )
    partial.rename(tarball)
    return tarball


def base_image(builder: Builder, cache: Path, asked: str | None) -> str:
    """The image the deps stage starts from."""
    if asked:
        return asked
    default = dockerfile_arg("BASE")
    if builder.has_image(default) or builder.pull(default):
        print(f"image: base {default}")
        return default
    if builder.has_image(FALLBACK_BASE):
        print(f"image: {default} cannot be pulled; base {FALLBACK_BASE} (built before)")
        return FALLBACK_BASE
    print(f"image: {default} cannot be pulled; building {FALLBACK_BASE} from Debian's packages")
    tarball = make_rootfs(cache)
    rootfs_context = cache / "rootfs-context"
    shutil.rmtree(rootfs_context, ignore_errors=True)
    rootfs_context.mkdir(parents=True)
    os.link(tarball, rootfs_context / "rootfs.tar")
    (rootfs_context / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\n")
    _run([*builder.build_cmd(), "-t", FALLBACK_BASE, str(rootfs_context)])
    shutil.rmtree(rootfs_context)
    return FALLBACK_BASE


def pip_ca_bundle() -> Path | None:
    """The CA bundle this machine's pip verifies the package index with, if one is set."""
    configured = os.environ.get("PIP_CERT") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.cert"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    return Path(configured) if configured and Path(configured).is_file() else None


def prepare_context(context: Path, extras: list[str], pins: list[str]) -> str:
    """Fill the build context; returns the wheel's file name."""
    shutil.rmtree(context, ignore_errors=True)
    context.mkdir(parents=True)
    (context / "requirements.txt").write_text(requirements_text(extras, pins))
    ca_bundle = pip_ca_bundle()
    if ca_bundle is not None:
        print(f"image: pip in the build trusts {ca_bundle}, as pip here does")
        shutil.copyfile(ca_bundle, context / "pip-ca.crt")
    else:
        (context / "pip-ca.crt").write_bytes(b"")
    shutil.copytree(REPO / "configs", context / "configs")
    print("image: building fleetrl's wheel from the checkout")
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
          "--wheel-dir", str(context), str(REPO)])  # fmt: skip
    wheels = sorted(p.name for p in context.glob("fleetrl-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one fleetrl wheel in {context}, found {wheels}")
    return wheels[0]


def deps_tag(base: str, builder: Builder, requirements: str) -> str:
    digest = hashlib.sha256()
    for part in (base, _image_id(builder, base), requirements, deps_stage_text()):
        digest.update(part.encode() + b"\0")
    return f"localhost/fleetrl-deps:{digest.hexdigest()[:16]}"


def _image_id(builder: Builder, ref: str) -> str:
    verb = ["inspect", "--type", "image"] if builder.name == "buildah" else ["image", "inspect"]
    fmt = "{{.FromImageID}}" if builder.name == "buildah" else "{{.Id}}"
    out = subprocess.run(
        [builder.name, *verb, "--format", fmt, ref], capture_output=True, text=True
    )
    return out.stdout.strip()


def _run(cmd: list[str]) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build(args: argparse.Namespace) -> str:
    """Build the image; returns its tag."""
    builder = find_builder(args.builder)
    print(f"image: builder {builder.name}")
    cache = Path(args.cache_dir).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    extras = [e for e in args.extras.split(",") if e]
    context = cache / "context"
    wheel = prepare_context(context, extras, args.pin)
    base = base_image(builder, cache, args.base)
    deps = deps_tag(base, builder, (context / "requirements.txt").read_text())
    if builder.has_image(deps):
        print(f"image: reusing {deps} (its requirements, base and stage are unchanged)")
    else:
        print(f"image: building {deps} (extras: {','.join(extras) or 'none'})")
        _run([*builder.build_cmd(), "--target", "deps", "--build-arg", f"BASE={base}",
              "-t", deps, "-f", str(DOCKERFILE), str(context)])  # fmt: skip
    tag = args.tag or f"fleetrl:{project_version()}"
    _run([*builder.build_cmd(), "--build-arg", f"DEPS={deps}", "--build-arg", f"WHEEL={wheel}",
          "-t", tag, "-f", str(DOCKERFILE), str(context)])  # fmt: skip
    print(f"image: built {tag}")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--builder", default="auto", choices=["auto", "docker", "podman", "buildah"]
    )
    parser.add_argument("--tag", default=None, help="default: fleetrl:<version in pyproject>")
    parser.add_argument("--extras", default="sglang", help="pyproject extras, comma-separated")
    parser.add_argument("--pin", action="append", default=[], help="a requirement put first")
    parser.add_argument("--base", default=None, help="the deps stage's base image")
    parser.add_argument("--cache-dir", default=str(REPO / ".image-cache"))
    args = parser.parse_args(argv)
    try:
        build(args)
    except BuildError as err:
        print(f"image: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"image: `{' '.join(map(str, err.cmd))}` exited {err.returncode}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
