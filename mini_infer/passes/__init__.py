"""Graph passes: capture, the pass manager, and one file per pass. `PASSES` maps names to classes.

`PASSES` is kept in pipeline order: `recommended_passes` takes every registered pass that has something to do
for the context (`GraphPass.default_for`), ordered by stage and, within a stage, by registration order.
"""

from mini_infer.passes.base import STAGES, GraphPass, PassConfigError, PassContext, PassResult
from mini_infer.passes.cleanup import Cleanup
from mini_infer.passes.fuse_act_quant import FuseActQuant
from mini_infer.passes.fuse_gate_up_silu import FuseGateUpSilu
from mini_infer.passes.fuse_gelu_mul import FuseGeluMul
from mini_infer.passes.fuse_gemma_rmsnorm import FuseGemmaRMSNorm
from mini_infer.passes.fuse_gemv_norm import FuseGemvNorm
from mini_infer.passes.fuse_kv_write import FuseKVWrite
from mini_infer.passes.fuse_lookups import FuseLookups
from mini_infer.passes.fuse_norm_gemv import FuseNormGemv
from mini_infer.passes.fuse_qk_rotary import FuseQKRotary
from mini_infer.passes.fuse_residual_gemvs import FuseResidualGemvs
from mini_infer.passes.fuse_rmsnorm import FuseRMSNorm
from mini_infer.passes.fuse_rotary import FuseRotary
from mini_infer.passes.fuse_rotary_attention import FuseRotaryAttention
from mini_infer.passes.fuse_silu_gemv import FuseSiluGemv
from mini_infer.passes.fuse_silu_mul import FuseSiluMul
from mini_infer.passes.gemv_linear import GemvLinear
from mini_infer.passes.merge_projections import MergeProjections
from mini_infer.passes.mla_latent_cache import MlaLatentCache
from mini_infer.passes.paged_attention import PagedAttention
from mini_infer.passes.quantize_fp8 import QuantizeFP8
from mini_infer.passes.quantize_moe_mxfp4 import QuantizeMoeMxfp4
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from mini_infer.passes.rotary_table import RotaryTable
from mini_infer.passes.route_moe import RouteMoe
from mini_infer.passes.select_logits import SelectLogits
from mini_infer.passes.shard_tensor_parallel import ShardTensorParallel

PASSES: dict[str, type[GraphPass]] = {
    p.name: p for p in (Cleanup, SelectLogits, ShardTensorParallel, QuantizeW8A8, QuantizeFP8, FuseRMSNorm,
                        FuseGemmaRMSNorm, FuseRotary, FuseQKRotary, RouteMoe, QuantizeMoeMxfp4, MergeProjections, FuseSiluMul,
                        FuseGeluMul, FuseActQuant, MlaLatentCache, PagedAttention, RotaryTable, FuseLookups, FuseRotaryAttention, FuseKVWrite, GemvLinear,
                        FuseResidualGemvs, FuseGemvNorm, FuseGateUpSilu, FuseSiluGemv, FuseNormGemv)
}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Make a pass class available by name (to `compile_model(passes=[...])`, the CLI and, through its
    `default_for`, the recommended pipeline)."""
    if cls.stage not in STAGES:
        raise ValueError(f"pass {cls.name!r}: unknown stage {cls.stage!r}; stages: {', '.join(STAGES)}")
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


def recommended_passes(ctx: PassContext) -> list[GraphPass]:
    """The pipeline for a model and its options: each registered pass's `default_for(ctx)`, by stage."""
    chosen = [inst for cls in PASSES.values() if (inst := cls.default_for(ctx)) is not None]
    return sorted(chosen, key=lambda p: STAGES.index(p.stage))  # stable: registration order within a stage


def add_passes(pipeline, extra) -> list:
    """`pipeline` (names or instances, in stage order) with the `extra` passes (names or instances) added, each
    placed after the pipeline's passes of its own and earlier stages: how an opt-in pass joins the recommended
    pipeline. Items come back as given; ValueError naming an unknown pass."""
    def stage(p) -> int:
        return STAGES.index(resolve_passes([p])[0].stage if isinstance(p, str) else p.stage)

    return sorted([*pipeline, *extra], key=stage)  # stable: the given order within a stage


__all__ = ["PASSES", "STAGES", "GraphPass", "PassConfigError", "PassContext", "PassResult", "add_passes",
           "recommended_passes", "register_pass", "resolve_passes"]
