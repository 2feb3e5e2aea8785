"""The model: MiniGPT's parameters in one flat buffer, its fused layers and their backward pass."""
