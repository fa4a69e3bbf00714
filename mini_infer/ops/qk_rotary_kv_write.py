"""`mini_infer::qk_rotary_kv_write`: `qk_rotary` whose rotated k rows, and the matching v rows, go straight into
the paged KV cache; it returns q_out only.

Inserted by the FuseKVWrite pass in place of a layer's `qk_rotary` and the cache write at the start of its
`paged_attention` (which becomes `paged_attention_cached`): one launch where there were two. Semantics (must not
change): `q_out, k_out = qk_rotary(q, k, cos, sin, q_weight, k_weight, eps)`, then
`write_kv_cache(k_out, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)` with k_out and v seen as packed
tokens [B*T, H, D] (token (b, t) is row b*T + t of slot_mapping; a negative slot writes nothing, the CUDA-graph
padding rows; fp8 caches store `x / scale` saturated and rounded as paged_attention.py's write does); returns
q_out. Layouts: q [B, Hq, T, D], k [B, Hk, T, D], v [B, Hk, T, Dv] (any strides), cos/sin as qk_rotary's, caches
[num_blocks, block_size, Hk, D | Dv] with unit last stride, slot_mapping [B*T] int. The cache bytes equal those
of the unfused pair's (bitwise, Triton or reference). The Triton kernel is qk_rotary's grid: programs of q rows
run `_rotary.rotate_rows` as qk_rotary's do; programs of k rows take `_rotary.rotated_rows`, round the rotated row
to k_out's dtype and store it, with the token's v row, at its slot (`_to_cache_values`, the write's conversion).
It mutates only k_cache / v_cache and imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.paged_attention import check_cache_layout, check_kv_scales, write_kv_cache_reference
from mini_infer.ops.qk_rotary import _check, _out_dtype, qk_rotary_reference, rotary_launch

__all__ = ["qk_rotary_kv_write", "qk_rotary_kv_write_reference", "qk_rotary_kv_write_triton"]


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> the packed token layout [B*T, H, D] (a view where the strides allow)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def qk_rotary_kv_write_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Plain torch: `qk_rotary_reference`, then `write_kv_cache_reference` of the rotated k and of v."""
    q_out, k_out = qk_rotary_reference(q, k, cos, sin, q_weight, k_weight, eps)
    write_kv_cache_reference(_tokens(k_out), _tokens(v), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_out


if HAS_TRITON:
    from mini_infer.ops._rotary import rotate_rows, rotated_rows
    from mini_infer.ops.paged_attention import _nan_free_v, _store_cache_rows
    from mini_infer.ops.quant import _tl_dtype

    @triton.jit
    def _qk_rotary_kv_write_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
        q_blocks, n_q_rows, n_k_rows, HQ, HK, T, HALF, DV, eps, block_size,
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sv0, sv1, sv2, sv3, sc0, sc2, sc3, ss0, ss2, ss3, sqo0, sqo1, sqo2,
        s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd,
        K_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # programs [0, q_blocks) take q's rows (b, h, t) as qk_rotary's do, the rest k's rows into the caches
        pid = tl.program_id(0)
        if pid < q_blocks:
            rotate_rows(q_ptr, cos_ptr, sin_ptr, qo_ptr, qw_ptr, pid, n_q_rows, HQ, T, HALF, eps,
                        sq0, sq1, sq2, sq3, sc0, 0, sc2, sc3, ss0, 0, ss2, ss3, sqo0, sqo1, sqo2,
                        BLOCK_R, BLOCK_H, False, HAS_Q_NORM)
        else:
            b, h, t, first, second, mask, o1, o2 = rotated_rows(
                k_ptr, cos_ptr, sin_ptr, kw_ptr, pid - q_blocks, n_k_rows, HK, T, HALF, eps,
                sk0, sk1, sk2, sk3, sc0, 0, sc2, sc3, ss0, 0, ss2, ss3, BLOCK_R, BLOCK_H, False, HAS_K_NORM)
            in_k = ((b * HK + h) * T + t) < n_k_rows
            slot = tl.load(slot_ptr + b * T + t, mask=in_k, other=-1).to(tl.int64)
            ok = in_k & (slot >= 0)  # negative slot: a padding token, nothing written
            # the rotated row rounded to qk_rotary's k_out dtype, then converted as the cache write converts it (each
            # row its own slot: a column of slots beside the rows' heads)
            m = mask & ok[:, None]
            _store_cache_rows(kc_ptr, ks_ptr, o1.to(K_DTYPE), slot[:, None], h, first, m, block_size, s_kcb, s_kco,
                              s_kch, 1, KV_FP8)
            _store_cache_rows(kc_ptr, ks_ptr, o2.to(K_DTYPE), slot[:, None], h, second, m, block_size, s_kcb, s_kco,
                              s_kch, 1, KV_FP8)
            dv = tl.arange(0, BLOCK_DV)[None, :]
            m = ok[:, None] & (dv < DV)
            x = _nan_free_v(tl.load(v_ptr + (b * sv0 + h * sv1 + t * sv2)[:, None] + dv * sv3, mask=m, other=0.0),
                            s_vcd)
            _store_cache_rows(vc_ptr, vs_ptr, x, slot[:, None], h, dv, m, block_size, s_vcb, s_vco, s_vch, s_vcd,
                              KV_FP8)


def _check_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    b, hk, t, d = k.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (b, hk, t):
        raise ValueError(f"qk_rotary_kv_write: v {tuple(v.shape)} must be [B, Hk, T, Dv] for k {tuple(k.shape)}")
    if tuple(k_cache.shape[2:]) != (hk, d) or tuple(v_cache.shape[2:]) != (hk, v.shape[3]):
        raise ValueError(f"qk_rotary_kv_write: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not "
                         f"hold k {tuple(k.shape)} / v {tuple(v.shape)} rows")
    check_cache_layout(k_cache, v_cache, "qk_rotary_kv_write")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != b * t:
        raise ValueError(f"qk_rotary_kv_write: slot_mapping {tuple(slot_mapping.shape)} needs one slot per token, "
                         f"{b * t}")


def qk_rotary_kv_write_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One Triton launch: q_out, and the rotated k and v in the caches. Any strides of q, k, v; cos/sin are
    broadcast (stride 0), never copied."""
    if not HAS_TRITON:
        raise RuntimeError("qk_rotary_kv_write_triton needs triton")
    _check(q, k, q_weight, k_weight)
    _check_kv(k, v, k_cache, v_cache, slot_mapping)
    kv_fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    q_out = torch.empty(q.shape, dtype=_out_dtype(q, q_weight, cos, sin), device=q.device)
    _, hq, t, d = q.shape
    dv = v.shape[3]
    if q.numel() + k.numel() == 0:
        return q_out
    ln = rotary_launch(q, k, cos, sin, q_weight, k_weight)
    c4, s4 = ln.cos, ln.sin
    ks, vs = (s if s is not None else slot_mapping for s in (k_scale, v_scale))  # unread without an fp8 cache
    _qk_rotary_kv_write_kernel[ln.grid](
        q, k, v, c4, s4, q_out, ln.q_weight, ln.k_weight, k_cache, v_cache, slot_mapping, ks, vs,
        ln.q_blocks, ln.n_q_rows, ln.n_k_rows, hq, k.shape[1], t, d // 2, dv, float(eps), k_cache.shape[1],
        *q.stride(), *k.stride(), *v.stride(),
        c4.stride(0), c4.stride(2), c4.stride(3), s4.stride(0), s4.stride(2), s4.stride(3), *q_out.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride(),
        K_DTYPE=_tl_dtype(_out_dtype(k, k_weight, cos, sin)), KV_FP8=kv_fp8, BLOCK_R=ln.block_r, BLOCK_H=ln.block_h,
        BLOCK_DV=next_pow2(dv), HAS_Q_NORM=q_weight is not None, HAS_K_NORM=k_weight is not None,
        num_warps=4, **pdl_args(q),
    )  # fmt: skip
    return q_out


@torch.library.custom_op("mini_infer::qk_rotary_kv_write", mutates_args=("k_cache", "v_cache"))
def qk_rotary_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """qk_rotary's q_out; its rotated k and v written into the paged caches: Triton on CUDA when available, else
    the torch reference."""
    impl = qk_rotary_kv_write_triton if use_triton(q) else qk_rotary_kv_write_reference
    return impl(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@qk_rotary_kv_write.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return q.new_empty(q.shape, dtype=_out_dtype(q, q_weight, cos, sin))
