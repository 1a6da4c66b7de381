"""Built-in models: a small GPT, a Llama-style decoder, a ResNet-like CNN, and emulated-accelerator layers for CPU
benchmarks."""

from .emulated import EmulatedLayer, EmulatedNet
from .gpt import GPT, GPTConfig, lm_loss, random_tokens
from .llama import Llama, LlamaConfig
from .resnet import ResNet

__all__ = ["GPT", "GPTConfig", "EmulatedLayer", "EmulatedNet", "Llama", "LlamaConfig", "ResNet", "lm_loss",
           "random_tokens"]
