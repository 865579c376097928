"""All-or-nothing weight loading: a model is used only when its weights cover its config.

`from_pretrained` fills a tensor the weight files lack with a random initialisation and goes
on (it only prints a load report); a draft loaded that way drafts from random layers. The
checks here turn that into an error:

- `IncompleteDraftError`: the files lack tensors the config implies (missing), hold tensors
  of another shape (mismatched), or hold tensors the config has no place for (unexpected:
  the config describes another model than the one trained). Tied weights (an output head
  tied to the input embeddings) are not missing. The message names the directory, the
  first few names of each kind and their count.
- `BrokenWeightsError`: a weights file that cannot be read (cut short, not safetensors),
  named by its path, instead of safetensors' bare `SafetensorError`.
- `NonFiniteWeightsError`: a loaded draft whose weights hold a NaN or an infinity (a training
  run that diverged): it would propose garbage at full speed. The message names the weights
  file and the first such tensor.

All are ValueErrors with one-line messages, so that the CLI reports them as `error: ...`.
"""

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from specdistill.errors import UserError

log = logging.getLogger("specdistill.models")
SHOWN = 4  # names shown per kind of problem


class IncompleteDraftError(UserError):
    """A model directory (a draft, a checkpoint, or a target) whose weights do not cover its
    config (missing, mismatched or unexpected tensors); loading it would leave randomly
    initialised tensors."""


class BrokenWeightsError(UserError):
    """A weights file that cannot be read: truncated, or not a safetensors file."""


class NonFiniteWeightsError(UserError):
    """A model whose weights, as loaded, hold a NaN or an infinity."""


def name_list(names: Iterable[str], shown: int = SHOWN) -> str:
    """'a, b, c, d, ... (54 in all)' for many names; 'a, b' for few."""
    names = sorted(names)
    head = ", ".join(names[:shown])
    return f"{head}, ... ({len(names)} in all)" if len(names) > shown else head


RESAVE = (
    "save config and weights together again (save_pretrained), or restore the config.json "
    "they were saved with"
)


def describe(
    source: str,
    missing: Iterable[str] = (),
    unexpected: Iterable[str] = (),
    mismatched: Iterable[str] = (),
    advice: str = RESAVE,
) -> str | None:
    """One line naming what does not match and what to do, or None when everything does."""
    missing, unexpected, mismatched = list(missing), list(unexpected), list(mismatched)
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors missing ({name_list(missing)})")
    if mismatched:
        shapes = name_list(mismatched)
        parts.append(f"{len(mismatched)} of another shape, file vs config ({shapes})")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the config ({name_list(unexpected)})")
    if not parts:
        return None
    return (
        f"{source}: the weights do not match the config: " + "; ".join(parts) + ". Refused "
        f"(a partial load would run randomly initialised tensors): {advice}"
    )


def check_loading_info(source: str, info: Mapping, *, unexpected: str = "refuse") -> None:
    """Refuse what `from_pretrained(..., output_loading_info=True)` reports as missing or of
    another shape; unexpected tensors are refused (`unexpected="refuse"`) or logged
    (`"warn"`: a target checkpoint may carry extra weights its model class does not use)."""
    mismatched = [_mismatch_name(entry) for entry in info.get("mismatched_keys") or ()]
    extra = list(info.get("unexpected_keys") or ())
    if unexpected == "warn" and extra:
        log.warning(
            "%s: %d weights unused by the config (%s)", source, len(extra), name_list(extra)
        )
        extra = []
    message = describe(source, info.get("missing_keys") or (), extra, mismatched)
    if message:
        raise IncompleteDraftError(message)


def _mismatch_name(entry) -> str:
    """transformers reports a mismatch as (name, file shape, model shape)."""
    if isinstance(entry, tuple | list) and len(entry) == 3:
        name, ours, theirs = entry
        return f"{name} {tuple(ours)} vs {tuple(theirs)}"
    return str(entry)


def weight_files(directory) -> list[Path]:
    """The safetensors files of a model directory."""
    return sorted(Path(directory).glob("*.safetensors"))


def check_weight_files(directory) -> None:
    """Open the header of every safetensors file in `directory`: a truncated or foreign file
    is a `BrokenWeightsError` naming it (safetensors checks that the header's offsets cover
    the file exactly)."""
    for path in weight_files(directory):
        tensor_names(path)


def tensor_names(path) -> set[str]:
    """The tensor names of one safetensors file; `BrokenWeightsError` if it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys())
    except SafetensorError as e:
        raise broken(path, e) from None


def read_safetensors(path) -> dict:
    """Every tensor of one safetensors file; `BrokenWeightsError` if it cannot be read."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise broken(path, e) from None


def broken(path, error: Exception) -> BrokenWeightsError:
    return BrokenWeightsError(
        f"{path}: cannot read the weights ({error}); the file is cut short or damaged: "
        "save or copy it again"
    )


def check_state_file(path, expected: Mapping, advice: str = RESAVE) -> None:
    """Refuse a safetensors state file (a training checkpoint's model.safetensors) that does
    not hold exactly the tensors of `expected` (a module's state_dict), with their shapes.
    Tensors sharing storage in `expected` (a tied head) need to be saved once only."""
    shapes = file_shapes(path)
    missing = [name for name in expected if name not in shapes]
    if missing:  # a tied tensor is saved under one of its names
        saved = {_storage(expected[name]) for name in expected if name in shapes}
        missing = [name for name in missing if _storage(expected[name]) not in saved]
    mismatched = [
        f"{name} {shapes[name]} vs {tuple(expected[name].shape)}"
        for name in expected
        if name in shapes and shapes[name] != tuple(expected[name].shape)
    ]
    unexpected = [name for name in shapes if name not in expected]
    message = describe(str(path), missing, unexpected, mismatched, advice)
    if message:
        raise IncompleteDraftError(message)


def _storage(tensor) -> tuple:
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


def header_shapes(directory) -> dict[str, tuple]:
    """name -> shape of every tensor in a model directory's safetensors files, read from
    their headers only; `BrokenWeightsError` for a file that cannot be read."""
    shapes: dict[str, tuple] = {}
    for path in weight_files(directory):
        shapes.update(file_shapes(path))
    return shapes


def file_shapes(path) -> dict[str, tuple]:
    """name -> shape of every tensor of one safetensors file, from its header;
    `BrokenWeightsError` if it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except SafetensorError as e:
        raise broken(path, e) from None


def check_header_shapes(
    directory, implied: Mapping[str, tuple], tied: Iterable[Iterable[str]] = ()
) -> None:
    """Refuse (`IncompleteDraftError`) a model directory whose weight files lack tensors of
    `implied` (the shapes its config implies; `tied`: groups of names sharing one tensor, saved
    under any one of them) or hold them in another shape, from the headers alone: before a
    model of the config's size is allocated. Directories without safetensors files are left
    to the loader."""
    shapes = header_shapes(directory)
    if not shapes:
        return
    saved = set(shapes)
    for group in map(set, tied):
        if group & shapes.keys():
            saved |= group
    missing = [name for name in implied if name not in saved]
    mismatched = [
        f"{name} {shapes[name]} vs {tuple(implied[name])}"
        for name in implied
        if name in shapes and shapes[name] != tuple(implied[name])
    ]
    message = describe(str(directory), missing, (), mismatched)
    if message:
        raise IncompleteDraftError(message)


def check_finite(source, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse (`NonFiniteWeightsError`) floating-point `tensors` ((name, tensor) pairs of a model
    loaded from `source`, a directory or a file) holding a NaN or an infinity; the message
    names the file the first such tensor came from and how many there are. One
    `isfinite(...).all()` per tensor."""
    bad = [
        (name, t.dtype)
        for name, t in tensors
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    if not bad:
        return
    name, dtype = bad[0]
    others = f" and {len(bad) - 1} more tensor(s)" if len(bad) > 1 else ""
    raise NonFiniteWeightsError(
        f"{file_of(source, name)}: tensor {name} ({str(dtype).removeprefix('torch.')}){others} "
        "holds NaN or infinite values: refused (the draft would propose garbage); a training "
        "run that diverged writes such weights: train it again with a lower train.lr"
    )


def check_module_finite(source, module: torch.nn.Module) -> None:
    """`check_finite` on a loaded module's parameters (its buffers are derived, not trained)."""
    check_finite(source, module.named_parameters())


def file_of(source, name: str) -> str:
    """The weights file of directory `source` that holds tensor `name`: the only safetensors
    file, or the one a sharded checkpoint's index maps it to; else `source` itself."""
    path = Path(source)
    if not path.is_dir():
        return str(source)
    files = weight_files(path)
    if len(files) == 1:
        return str(files[0])
    index = path / "model.safetensors.index.json"
    try:
        shard = json.loads(index.read_text())["weight_map"][name]
    except (OSError, ValueError, KeyError, TypeError):
        return str(source)
    return str(path / shard)
