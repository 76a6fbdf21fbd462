"""An independent functional implementation of NVIDIA's ResNet / ResNeXt / SE-ResNeXt forward pass.

Written from SPEC §2 with ``torch.nn.functional`` only, reading tensors from a state dict in the
NGC 20.06 layout; it shares no code with ``convnets.models``. Tests compare the package's modules
(and everything built on them) against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _bn(x: Tensor, sd: dict[str, Tensor], prefix: str) -> Tensor:
    return F.batch_norm(x, sd[f"{prefix}.running_mean"], sd[f"{prefix}.running_var"],
                        sd[f"{prefix}.weight"], sd[f"{prefix}.bias"], training=False, eps=1e-5)


def _block(x: Tensor, sd: dict[str, Tensor], p: str, stride: int) -> Tensor:
    w2 = sd[f"{p}.conv2.weight"]
    groups = sd[f"{p}.conv1.weight"].shape[0] // w2.shape[1]
    out = F.relu(_bn(F.conv2d(x, sd[f"{p}.conv1.weight"]), sd, f"{p}.bn1"))
    out = F.relu(_bn(F.conv2d(out, w2, stride=stride, padding=1, groups=groups), sd, f"{p}.bn2"))
    out = _bn(F.conv2d(out, sd[f"{p}.conv3.weight"]), sd, f"{p}.bn3")
    if f"{p}.downsample.0.weight" in sd:
        residual = _bn(F.conv2d(x, sd[f"{p}.downsample.0.weight"], stride=stride), sd, f"{p}.downsample.1")
    else:
        residual = x
    if f"{p}.squeeze.squeeze.weight" in sd:
        s = out.mean(dim=(2, 3))
        s = F.relu(F.linear(s, sd[f"{p}.squeeze.squeeze.weight"].flatten(1), sd[f"{p}.squeeze.squeeze.bias"]))
        s = torch.sigmoid(F.linear(s, sd[f"{p}.squeeze.expand.weight"].flatten(1), sd[f"{p}.squeeze.expand.bias"]))
        out = residual + out * s[:, :, None, None]
    else:
        out = residual + out
    return F.relu(out)


@torch.no_grad()
def reference_forward(sd: dict[str, Tensor], x: Tensor) -> Tensor:
    """Logits of the network whose NGC-layout (``layer1..N``, no prefix) state dict is ``sd``."""
    sd = {k: v.float() for k, v in sd.items()}
    x = F.relu(_bn(F.conv2d(x, sd["conv1.weight"], stride=2, padding=3), sd, "bn1"))
    x = F.max_pool2d(x, 3, stride=2, padding=1)
    stage = 1
    while f"layer{stage}.0.conv1.weight" in sd:
        block = 0
        while f"layer{stage}.{block}.conv1.weight" in sd:
            x = _block(x, sd, f"layer{stage}.{block}", 2 if stage > 1 and block == 0 else 1)
            block += 1
        stage += 1
    x = x.mean(dim=(2, 3))
    return F.linear(x, sd["fc.weight"], sd["fc.bias"])
