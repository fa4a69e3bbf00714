"""mini-infer: a compiler-style LLM inference engine for Hugging Face causal LMs."""

from mini_infer.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompiledModel", "SamplingParams", "compile_model", "load_model", "__version__"]


def __getattr__(name: str):  # lazy: `import mini_infer` stays cheap (torch/transformers load on first use)
    if name == "LLM":
        from mini_infer.llm import LLM

        return LLM
    if name in ("compile_model", "CompiledModel"):
        from mini_infer import compiler

        return getattr(compiler, name)
    if name == "load_model":
        from mini_infer.models import load_model

        return load_model
    raise AttributeError(f"module 'mini_infer' has no attribute {name!r}")
