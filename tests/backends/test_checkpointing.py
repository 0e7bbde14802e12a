"""Activation checkpointing: same gradients, less stored, clear errors."""

import pytest
import torch

from examples.char_lm.recipe import CharLM
from sailfin import ConfigError, Trainer
from sailfin.backends.checkpointing import apply_activation_checkpointing
from tests.recipes import IdData, LinearRecipe, args


def tiny_lm(dropout=0.0):
    torch.manual_seed(0)
    return CharLM(None, context=16, layers=2, dim=32, heads=2, dropout=dropout)


def batch():
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4, 17), generator=g)
    return data[:, :-1], data[:, 1:]


def grads_and_saved_bytes(module):
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(5)  # dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.train_step(0, batch(), torch.device("cpu"))
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}, sum(saved.values())


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointed_gradients_equal_plain_ones(dropout):
    plain_grads, plain_bytes = grads_and_saved_bytes(tiny_lm(dropout))
    module = tiny_lm(dropout)
    assert apply_activation_checkpointing(module, ["Block"]) == ["blocks.0", "blocks.1"]
    ckpt_grads, ckpt_bytes = grads_and_saved_bytes(module)
    assert ckpt_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6)
    assert ckpt_bytes < plain_bytes / 2  # the blocks' activations were not kept


def test_state_dict_keys_do_not_change_and_wrapping_is_idempotent():
    module = tiny_lm()
    keys = list(module.state_dict())
    apply_activation_checkpointing(module, ["Block", "SelfAttention"])
    assert list(module.state_dict()) == keys
    forward = module.blocks[0].forward
    assert apply_activation_checkpointing(module, ["Block"]) == ["blocks.0", "blocks.1"]
    assert module.blocks[0].forward is forward  # not checkpointed twice
    with torch.no_grad():  # validation: runs plainly
        assert module(batch()[0]).shape == (4, 16, 256)


def test_unknown_class_lists_the_classes_present(tmp_path):
    module = LinearRecipe(IdData(20, 0))
    trainer = Trainer(module, args(tmp_path, activation_checkpointing=["Linnear"]))
    with pytest.raises(ConfigError, match=r"trainer.activation_checkpointing\[0\] is 'Linnear' "
                                          r"\(did you mean 'Linear'\?\).*classes present: "
                                          r"Dropout, Linear"):
        trainer.train()


def test_trainer_applies_it_in_setup(tmp_path):
    module = tiny_lm()
    module.get_train_dataloader = lambda sampler, batch_size: torch.utils.data.DataLoader(
        _Pairs(), batch_size=batch_size, sampler=sampler(_Pairs()))
    module.get_val_dataloaders = lambda sampler, batch_size: {}
    trainer = Trainer(module, args(tmp_path, train_batch_size=4, micro_batch_size=4,
                                   activation_checkpointing=["Block"]))
    summary = trainer.train()
    assert trainer.backend.checkpointed == ["blocks.0", "blocks.1"]
    assert summary["global_step"] == 2


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        x, y = batch()
        return x[i % 4], y[i % 4]
