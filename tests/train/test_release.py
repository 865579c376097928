"""The end of a multi-process run frees the draft's DDP wrapper before the process group is
destroyed (train/step.py `release_wrapper`), so that the group is not freed last by DDP's
reducer: that order can hang the process at exit."""

import gc
import weakref

import torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

from specdistill import drafts
from specdistill.models import hub
from specdistill.train.config import load_recipe
from specdistill.train.step import DistillStep
from tests.train.helpers import overrides


def test_release_wrapper_frees_the_ddp_wrapper_while_the_group_lives(tiny_pair, tmp_path):
    target_dir, _, _ = tiny_pair
    recipe = load_recipe(None, overrides(tiny_pair, tmp_path / "run"))
    target = hub.load_target(str(target_dir), None)
    tokenizer = hub.load_tokenizer(str(target_dir))
    draft, kind = drafts.build(recipe.draft, target, tokenizer, None, print=lambda *a: None)
    core = DistillStep(
        recipe, accelerator=Accelerator(cpu=True), target=target, draft=draft, kind=kind
    )
    plain = core.draft
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapper = DistributedDataParallel(plain)
        core.draft = wrapper  # as accelerate's prepare leaves it in a multi-process run
        assert core.draft_module() is plain
        freed = weakref.ref(wrapper)
        del wrapper
        gc.collect()
        assert freed() is not None  # the core holds it
        core.release_wrapper()
        assert freed() is None and core.draft is plain
        assert dist.is_initialized()  # the group outlives the wrapper
    finally:
        dist.destroy_process_group()
