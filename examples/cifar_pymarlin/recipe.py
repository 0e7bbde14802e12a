"""A PyMarlin CIFAR-10 recipe, moved to sailfin as docs/migrating-from-pymarlin.md says.

PyMarlin's image-classification example trains the classic small CNN (two
5x5 convolutions, three linear layers) with SGD on CIFAR-10. This port keeps
its classes, method names and model; what changed is what the migration doc
lists:

- imports: ``from sailfin import DataInterface, ModuleInterface``;
- ``val_step`` returns a dict of per-sample values, not a ``(loss, logits,
  labels)`` tuple, and ``on_end_val_epoch`` returns the metrics to log;
- ``on_end_train_epoch(global_step, epoch)`` (PyMarlin passed the epoch's
  collated train_step outputs);
- the config names the classes (``class_path``) and ``sailfin train`` builds
  them, instead of a ``__main__`` block with ``CustomArgParser``.

The data are synthetic images of CIFAR-10's shape (3x32x32, 10 classes, a
class-dependent colour and pattern plus noise) so the example runs offline;
``CifarData(root=...)`` reads the real set through torchvision when it is
installed and the files are there.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sailfin import DataInterface, ModuleInterface


def synthetic_cifar(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` learnable 3x32x32 images in 10 classes: each class has its own mean colour and
    stripe frequency; the noise hides it partly."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    colours = torch.rand(10, 3, 1, 1, generator=torch.Generator().manual_seed(1234))
    rows = torch.arange(32, dtype=torch.float32).view(1, 1, 32, 1)
    stripes = torch.sin(rows * (labels.view(-1, 1, 1, 1) + 1) * 0.3)
    images = colours[labels] + 0.3 * stripes + 1.2 * torch.randn(n, 3, 32, 32, generator=g)
    return torch.utils.data.TensorDataset((images - 0.5) / 0.5, labels)


class CifarData(DataInterface):
    """CIFAR-10: synthetic by default; the real set from ``root`` if torchvision has it."""

    def __init__(self, n_train: int = 2000, n_val: int = 500, root: Optional[str] = None
                 ) -> None:
        if root is not None:
            import torchvision  # optional: only for the real data
            from torchvision import transforms

            to_tensor = transforms.Compose([transforms.ToTensor(),
                                            transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
            self.train = torchvision.datasets.CIFAR10(root, train=True, transform=to_tensor)
            self.val = torchvision.datasets.CIFAR10(root, train=False, transform=to_tensor)
        else:
            self.train = synthetic_cifar(n_train, seed=1)
            self.val = synthetic_cifar(n_val, seed=2)

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


class Net(nn.Module):
    """The small CNN of PyMarlin's CIFAR example (and of PyTorch's CIFAR tutorial)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CifarModule(ModuleInterface):
    """PyMarlin's CIFAR module: the same methods, with sailfin's val_step form."""

    def __init__(self, data: CifarData, lr: float = 0.001, momentum: float = 0.9) -> None:
        super().__init__()
        self.data = data
        self.lr, self.momentum = lr, momentum
        self.net = Net()
        self.criterion = nn.CrossEntropyLoss()
        self.epoch_ends: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch: int, epochs: int):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        return [optimizer], []

    def train_step(self, global_step: int, batch, device):
        inputs, labels = batch[0].to(device), batch[1].to(device)
        return self.criterion(self.net(inputs), labels)  # the batch's mean loss

    def val_step(self, global_step: int, batch, device):
        inputs, labels = batch[0].to(device), batch[1].to(device)
        logits = self.net(inputs)
        # Per sample: PyMarlin returned (loss, logits, labels) with a batch-mean loss.
        return {"loss": F.cross_entropy(logits, labels, reduction="none"),
                "pred": logits.argmax(1), "label": labels}

    def on_end_train_epoch(self, global_step: int, epoch: int) -> None:
        self.epoch_ends.append((global_step, epoch))

    def on_end_val_epoch(self, global_step: int, outputs, key: str = "val"):
        return {"loss": outputs["loss"].mean().item(),
                "accuracy": (outputs["pred"] == outputs["label"]).float().mean().item()}
