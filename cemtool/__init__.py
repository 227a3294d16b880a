"""cemtool: train small language models of several Transformer layer families and measure them."""

__version__ = "0.1.0"
