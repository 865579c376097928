"""The output directory of an evaluation command (`speculate`, `drift`): claimed before any
model loads, refused when it already holds files unless told to overwrite
(`specdistill.publish.claim_output_dir`), and removed again if the command fails before
writing into it, so a failed run leaves no empty directory behind."""

import contextlib
import os
from pathlib import Path

from specdistill.publish import claim_output_dir


@contextlib.contextmanager
def claimed_output_dir(out: str | os.PathLike, *, overwrite: bool, flag: str = "--overwrite"):
    """`with claimed_output_dir(out, overwrite=...) as path:` run the command. The
    directories this call creates (`out` and missing parents) are removed on an exception
    while they are still empty; nothing that holds a file is ever removed."""
    out = Path(out)
    created = []
    for path in (out, *out.parents):
        if path.exists():
            break
        created.append(path)
    claimed = claim_output_dir(out, overwrite=overwrite, flag=flag)
    try:
        yield claimed
    except BaseException:
        for path in created:  # deepest first
            try:
                path.rmdir()
            except OSError:  # holds something, or already gone
                break
        raise
