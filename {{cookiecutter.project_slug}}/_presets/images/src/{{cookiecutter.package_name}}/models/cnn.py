"""A small convolutional network with dropout: replace it with your own network; task.py builds it."""

from __future__ import annotations

import torch
from torch import nn


class Standardize(nn.Module):
    """Each image shifted and scaled to mean 0 and standard deviation 1 over all its pixels.

    The network then sees shapes and contrasts, not how bright or how colourful an image is: with random
    colours per image, it learns several times faster. Per image, so it needs no statistics of the data.
    """

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        mean = images.mean(dim=(1, 2, 3), keepdim=True)
        std = images.std(dim=(1, 2, 3), keepdim=True)
        return (images - mean) / (std + 1e-3)  # + 1e-3: a single-colour image stays finite


class SpatialMean(nn.Module):
    """The mean of each channel over all positions: any image size gives one feature per channel.

    Written out instead of nn.AdaptiveAvgPool2d(1), whose CUDA backward pass has no deterministic kernel.
    """

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.mean(dim=(2, 3))


def build_cnn(num_classes: int, channels: int, dropout: float) -> nn.Module:
    """Three stages of 3x3 convolution + ReLU + 2x2 max-pooling (`channels`, 2x, 4x wide), then the mean
    over the remaining positions and a linear classifier.

    No batch normalization on purpose: its running statistics would be updated by each process's own
    batches, so 2 processes would not train the same weights as 1 process with accumulation.
    """

    def stage(inputs: int, outputs: int) -> list[nn.Module]:
        return [nn.Conv2d(inputs, outputs, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        Standardize(),
        *stage(3, channels),
        *stage(channels, 2 * channels),
        *stage(2 * channels, 4 * channels),
        SpatialMean(),
        nn.Dropout(dropout),
        nn.Linear(4 * channels, num_classes),
    )
