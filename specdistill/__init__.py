"""specdistill: train speculative-decoding draft models that maximise acceptance.

The repository's top-level folders are this package's subpackages (see pyproject.toml):
`specdistill.data` (data/), `specdistill.losses` (losses/), `specdistill.drafts` (drafts/),
`specdistill.eval` (eval/), `specdistill.train` (train/), `specdistill.recipes` (recipes/).
"""

__version__ = "0.1.0"
