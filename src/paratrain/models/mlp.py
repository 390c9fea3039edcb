"""Multi-layer perceptron for 28x28 single-channel images (MNIST, Fashion-MNIST).

Layout: one ``nn.Sequential`` entry per torch module, never grouped::

    0: Flatten
    1: Linear(in_features, hidden)   2: ReLU
    3: Linear(hidden, hidden)        4: ReLU       (depth pairs in all)
    ...
    2 * depth + 1: Linear(hidden, classes)         (in_features -> classes when depth == 0)

Flat entries were chosen over (Linear, ReLU) groups because both consumers want them:
tensor parallelism finds and swaps ``nn.Linear`` children by index, and a pipeline split
anywhere is valid (every entry maps one tensor to one tensor). Flatten and ReLU carry no
parameters, so a partitioner that balances by parameters or time can treat them as free.
"""

from __future__ import annotations

from torch import nn

from paratrain.models._checks import require_int


def mlp(
    *, in_features: int = 784, hidden: int = 256, depth: int = 3, classes: int = 10
) -> nn.Sequential:
    """Build Flatten, ``depth`` (Linear, ReLU) pairs, then a Linear to ``classes`` logits.

    Input may be images ``(N, 1, 28, 28)`` or already flat ``(N, 784)``: Flatten keeps the
    batch dimension either way. ``depth=0`` gives multinomial logistic regression, which is
    useful as the smallest possible model in tests. No dropout, so a parallel run can be
    compared with one device exactly.
    """
    require_int(in_features=in_features, hidden=hidden, classes=classes)
    require_int(minimum=0, depth=depth)
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)
