"""mini-infer: a compiler-style LLM inference engine for Hugging Face causal LMs."""

from mini_infer.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["SamplingParams", "__version__"]
