"""runtime.placement: a built module's tensors go to the device eager GPU runs use (here the meta
device stands in for one), nested layers included, shared tensors stay shared, configs untouched."""
import torch

from builder import embedded
from builder.checkpoint import load_checkpoint
from builder.drafts import load_draft
from builder.models.nemotron_h import NemotronH
from runtime.placement import devices, place

META = torch.device("meta")


def test_every_tensor_of_target_and_draft_moves_and_shared_ones_stay_shared():
    config, weights = load_checkpoint(embedded.target_dir())
    draft = load_draft("eagle3", config, weights, embedded.draft_dir("eagle3"), torch.float32, log=lambda m: None)
    target = NemotronH(config, weights, torch.float32, **draft.target_features)
    assert devices(target) == {torch.device("cpu")} and devices(draft.module) == {torch.device("cpu")}
    cfg_before = target.cfg
    moved: dict = {}
    place(draft.module, "meta", moved)
    place(target, "meta", moved)
    assert devices(target) == {META} and devices(draft.module) == {META}
    assert target.cfg is cfg_before
    assert len(moved) > 10   # every weight went through the memo, once


def test_shared_tensor_stays_one_tensor_and_same_device_is_no_copy():
    class Holder:   # a model object as builder.models writes them
        __module__ = "builder.models.fake"

        def __init__(self, w, items):
            self.w, self.items, self.config = w, items, ("kept", 3)

    w = torch.ones(3)
    a, b = Holder(w, [w, {"x": w}]), Holder(w, (w,))
    moved: dict = {}
    place(a, "meta", moved)
    place(b, "meta", moved)
    assert a.w is b.w is a.items[0] is a.items[1]["x"] is b.items[0] and a.w.device == META
    assert a.config == ("kept", 3)
    c = Holder(w, [w])
    place(c, "cpu")
    assert c.w is w and c.items[0] is w

