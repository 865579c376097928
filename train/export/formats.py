"""The export formats and their tables, assembled from what the registered draft types
contribute.

  vllm    the directories vLLM loads as a draft
  sglang  the directories SGLang loads as a draft
  hf      the layout of the Hugging Face Hub, which is what vLLM loads (each type writes
          there what it writes for vllm)

No format is written here: each draft type writes its drafts in its own subpackage
(drafts/<type>/) and declares, as its `exports` (a `drafts.export.Exports`), its writer per
format, its reader per layout and its serve hint per format (drafts/export.py describes the
interface). The tables below are that, keyed by each type's `capabilities.export_as`: a type
and its variants (a reduced vocabulary, another layout of the same head) are written alike
and share one record. They are assembled from the registry (drafts/registry.py) each time
they are asked, so a type registered later (a plug-in's, a test's) is in them.
"""

from specdistill.drafts import registry
from specdistill.drafts.export import Exports, Reader, Writer

FORMATS = ("vllm", "sglang", "hf")


def rows() -> dict[str, Exports]:
    """export_as -> the `Exports` of the registered types written that way. Two types under
    one key with different records are a bug in one of them (a ValueError)."""
    found: dict[str, Exports] = {}
    owner: dict[str, type] = {}
    for kind in registry.detected():
        key = kind.capabilities.export_as
        if found.setdefault(key, kind.exports) is not kind.exports:
            raise ValueError(
                f"draft types {owner[key].__name__} and {kind.__name__} both export as "
                f"{key!r} with different `exports`: one export_as, one record"
            )
        owner.setdefault(key, kind)
    return found


def writers(fmt: str) -> dict[str, Writer]:
    """The format's WRITERS table: export_as -> (model, Options) -> Plan."""
    return {key: row.writers[fmt] for key, row in rows().items() if fmt in row.writers}


def readers(layout: str) -> dict[str, Reader]:
    """The READERS table of a layout (a format): export_as -> (directory) -> module."""
    return {key: row.readers[layout] for key, row in rows().items() if layout in row.readers}


def hints(fmt: str) -> dict[str, str]:
    """The format's HINTS table: export_as -> the serve command's template (`{out}`,
    `{target}`, `{tokens}`, `{draft_tokens}`)."""
    return {key: row.hints[fmt] for key, row in rows().items() if fmt in row.hints}
