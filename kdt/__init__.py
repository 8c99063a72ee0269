"""kdt: DeepSeek-V3 / Kimi-K2 (MLA + MoE) inference with DDTree speculative decoding."""

__version__ = "0.1.0"
