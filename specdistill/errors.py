"""One line per anticipated error, for every command-line entry point.

A bad recipe, malformed data, a missing file: the message names the problem, so the user
sees `error: <message>` on stderr and exit status 2, not a traceback. `--debug` (on
`specdistill`) or SPECDISTILL_DEBUG=1 re-raises instead. Imports nothing from the project
but specdistill/publish.py (standard library only), so every layer's modules can use it.

Anticipated means one of the project's own error types (`UserError` and its subclasses:
RecipeError, DataError, PromptError, VocabMapError, ExportError, ...; `UserFileError`), or a
`FileNotFoundError` (a path the user gave that is not there). Any other exception is a bug:
its traceback is printed as Python prints it. specdistill/publish.py, which imports nothing
but the standard library, keeps its `OutputDirError` a ValueError; it is listed here.
"""

import os
import sys

from specdistill.publish import OutputDirError


class UserError(ValueError):
    """An error in what the user gave (a recipe, a data file, a model or output directory), with
    a message that names the problem and what to do. A ValueError, so callers that catch
    ValueError keep catching it."""


class UserFileError(OSError):
    """The same for a file or directory, as an OSError (errno, filename), so callers that catch
    OSError keep catching it."""


def debugging() -> bool:
    return os.environ.get("SPECDISTILL_DEBUG", "").lower() not in ("", "0", "false", "no")


# Errors whose message is the whole story (a user's input, not a bug in this program).
ANTICIPATED = (UserError, UserFileError, OutputDirError, FileNotFoundError)


def run_guarded(main, argv: list[str]) -> int:
    """Run a verb's main; an anticipated error becomes one line on stderr and exit 2."""
    try:
        rc = main(argv)
    except ANTICIPATED as e:
        if debugging():
            raise
        kind = "recipe error" if type(e).__name__ == "RecipeError" else "error"
        print(f"{kind}: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return rc if isinstance(rc, int) else 0


def one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())
