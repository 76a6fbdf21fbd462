"""convnets: NVIDIA's ResNet-family image classifiers with verified pretrained weights."""
