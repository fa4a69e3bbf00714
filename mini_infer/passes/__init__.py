"""Graph passes: capture, the pass manager, and one file per pass. `PASSES` maps names to classes."""

from mini_infer.passes.base import GraphPass, KVCacheSpec, PassContext, PassResult
from mini_infer.passes.cleanup import Cleanup
from mini_infer.passes.fuse_rmsnorm import FuseRMSNorm
from mini_infer.passes.fuse_rotary import FuseRotary
from mini_infer.passes.fuse_silu_mul import FuseSiluMul
from mini_infer.passes.gemv_linear import GemvLinear
from mini_infer.passes.merge_projections import MergeProjections
from mini_infer.passes.paged_attention import PagedAttention
from mini_infer.passes.select_logits import SelectLogits

PASSES: dict[str, type[GraphPass]] = {
    p.name: p for p in (Cleanup, FuseRMSNorm, FuseRotary, FuseSiluMul, MergeProjections, GemvLinear, PagedAttention,
                        SelectLogits)
}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Make a pass class available by name (to `compile_model(passes=[...])` and the CLI)."""
    PASSES[cls.name] = cls
    return cls


def resolve_passes(passes) -> list[GraphPass]:
    """Names or GraphPass instances → instances; ValueError naming an unknown pass and listing valid ones."""
    out = []
    for p in passes:
        if isinstance(p, GraphPass):
            out.append(p)
        elif isinstance(p, str) and p in PASSES:
            out.append(PASSES[p]())
        else:
            raise ValueError(f"unknown pass {p!r}; valid passes: {', '.join(PASSES)}")
    return out


__all__ = ["PASSES", "GraphPass", "KVCacheSpec", "PassContext", "PassResult", "register_pass", "resolve_passes"]
