"""LeNet-5 as it is usually run on 28x28 (Fashion-)MNIST.

Layout: one ``nn.Sequential`` entry per torch module (see ``mlp.py`` for why)::

    0: Conv2d(in_channels, 6, 5, padding=2)  1: ReLU  2: MaxPool2d(2)    -> (N, 6, 14, 14)
    3: Conv2d(6, 16, 5)                      4: ReLU  5: MaxPool2d(2)    -> (N, 16, 5, 5)
    6: Flatten                                                           -> (N, 400)
    7: Linear(400, 120)  8: ReLU  9: Linear(120, 84)  10: ReLU  11: Linear(84, classes)

The padding of 2 on the first convolution stands in for the 32x32 inputs of the original
paper. ReLU and max pooling replace the original sigmoid and average pooling because they
train in a few epochs instead of tens; the shapes and parameter count are the classic ones.
"""

from __future__ import annotations

from torch import nn

from paratrain.models._checks import require_int


def lenet(*, classes: int = 10, in_channels: int = 1) -> nn.Sequential:
    """Build LeNet-5 for ``(N, in_channels, 28, 28)`` images, returning ``(N, classes)`` logits."""
    require_int(classes=classes, in_channels=in_channels)
    return nn.Sequential(
        nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, classes),
    )
