"""A tiny byte-level GPT (the char_lm example's model) on synthetic bytes, for fast tests."""

import torch

from examples.char_lm.recipe import CharLM


class RandomBytes(torch.utils.data.Dataset):
    def __init__(self, n=32, context=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (n, context + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class TinyLM(CharLM):
    """CharLM with 1-2 small layers; records every step's loss."""

    def __init__(self, n=32, layers=1, seed=0, **kw):
        torch.manual_seed(seed)
        super().__init__(None, context=16, layers=layers, dim=32, heads=2, **kw)
        self.train_set = RandomBytes(n)
        self.losses = []

    def get_train_dataloader(self, sampler, batch_size):
        return torch.utils.data.DataLoader(self.train_set, batch_size=batch_size,
                                           sampler=sampler(self.train_set))

    def get_val_dataloaders(self, sampler, batch_size):
        return {}

    def on_end_train_step(self, global_step, loss, stats):
        self.losses.append(loss.item())
