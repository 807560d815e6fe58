"""Attention for a few query rows on MLX's CUDA backend, as one custom kernel (issue 35).

A WeDLM or speculative forward has 2-32 query rows per sequence and an explicit mask (or a
causal one). MLX-CUDA sends any attention of more than one query row to cuDNN's fused
attention, which costs the host a cuDNN graph encode and a CUDA-graph update per layer
(RESULTS SC9). One query row takes MLX's vector kernel and pays neither; this kernel is
that idea for 2-32 rows with a mask: a block per query row, all of whose keys it scores
at once. On an H200 (RESULTS SC10) a call costs 18-36 us of host and device against
cuDNN's 43-49, and a 2-32-row forward of the 135M model 1.1-3.4 ms less; the issue's
benchmark went from 1.7x to 2.9-3.1x AR (WeDLM, counting, C = 1). It also takes one row
with a mask array (AR rows of different lengths in one forward), which MLX-CUDA's vector
kernel refuses and MLX then composes from separate ops.

It reads keys and values in place (the KV buffers' strided slices), honours grouped-query
heads, and writes [B, T, H, D] so that mlx-lm's transpose-and-reshape after attention
costs no copy. Only for CUDA: Metal's own attention kernels take masked small queries
with no per-call graph, and the CPU has no kernels to launch. WEDLM_SMALL_QUERY_ATTENTION=0 turns
it off, =wide leaves one-row attention to MLX (A/B runs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import mlx.core as mx

from common.env_switches import SMALL_QUERY_ATTENTION

MAX_QUERIES = 32  # more rows (prefill chunks) go to cuDNN, which is then the faster
MAX_KEYS = 4096  # the scores of one query row live in shared memory (16 KiB)
THREADS = 256  # per query row
HEAD_DIMS = (64, 128)
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# One block per (row b, head h, query t). Latency, not work, bounds a kernel this small, so
# each phase issues its loads side by side: (1) a thread per key scores it against the
# query (kept in shared memory), reading the key row as 16-byte vectors; (2) the block
# takes the scores' max and sum; (3) D / 8 threads per key read its value row as vectors,
# a block-wide sweep over the keys, and the partial sums are folded together.
_SOURCE = """
    const int Tq = q_shape[2];
    const int Hq = q_shape[1];
    const int Hkv = k_shape[1];
    const int S = k_shape[2];
    const int row = blockIdx.x;
    const int t = row % Tq;
    const int h = (row / Tq) % Hq;
    const int b = row / (Tq * Hq);
    const int kh = h / (Hq / Hkv);
    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    constexpr int WARPS = THREADS / 32;
    constexpr int VEC = 16 / sizeof(T);
    constexpr float UNSEEN = -3.0e38f;  // a masked key's score

    __shared__ float qs[D];
    __shared__ float scores[MAX_KEYS];
    __shared__ float red[WARPS];
    __shared__ float part[THREADS / (D / VEC)][D];

    const T* qp = q + b * q_strides[0] + h * q_strides[1] + t * q_strides[2];
    const float scale = static_cast<float>(scale_in[0]);
    for (int i = tid; i < D; i += THREADS) {
        qs[i] = static_cast<float>(qp[i * q_strides[3]]) * scale;
    }
    const T* kb = k + b * k_strides[0] + kh * k_strides[1];
    const T* vb = v + b * v_strides[0] + kh * v_strides[1];
    // the key rows as 16-byte vectors where they are contiguous and aligned
    const bool vec_ok = k_strides[3] == 1
        && ((reinterpret_cast<size_t>(kb) | (k_strides[2] * sizeof(T))) % 16) == 0;
{SEEN_SETUP}
    __syncthreads();

    // (1) scores, UNSEEN where the key is not seen
    float top = UNSEEN;
    for (int j = tid; j < S; j += THREADS) {
        float sc = UNSEEN;
        if ({SEEN}) {
            const T* kp = kb + j * k_strides[2];
            float acc = 0.0f;
            if (vec_ok) {
#pragma unroll
                for (int c = 0; c < D / VEC; ++c) {
                    const uint4 raw = reinterpret_cast<const uint4*>(kp)[c];
                    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        acc += qs[c * VEC + i] * static_cast<float>(e[i]);
                    }
                }
            } else {
                for (int i = 0; i < D; ++i) {
                    acc += qs[i] * static_cast<float>(kp[i * k_strides[3]]);
                }
            }
            sc = acc;
        }
        scores[j] = sc;
        top = fmaxf(top, sc);
    }

    // (2) the block's max, then exp and the sum
    for (int off = 16; off > 0; off /= 2) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, off));
    }
    if (lane == 0) {
        red[warp] = top;
    }
    __syncthreads();
    top = red[0];
    for (int w = 1; w < WARPS; ++w) {
        top = fmaxf(top, red[w]);
    }
    __syncthreads();
    float total = 0.0f;
    for (int j = tid; j < S; j += THREADS) {
        const float p = scores[j] == UNSEEN ? 0.0f : __expf(scores[j] - top);
        scores[j] = p;
        total += p;
    }
    for (int off = 16; off > 0; off /= 2) {
        total += __shfl_xor_sync(0xffffffff, total, off);
    }
    if (lane == 0) {
        red[warp] = total;
    }
    __syncthreads();
    total = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
        total += red[w];
    }

    // (3) the values, weighted: ROWS keys at a time, each read by D / VEC threads as
    // 16-byte vectors; no branch around the loads (an unseen key's weight is 0), so
    // they issue side by side
    constexpr int ROW_THREADS = D / VEC;
    constexpr int ROWS = THREADS / ROW_THREADS;
    const int c = tid % ROW_THREADS;
    const int r = tid / ROW_THREADS;
    const bool v_vec_ok = v_strides[3] == 1
        && ((reinterpret_cast<size_t>(vb) | (v_strides[2] * sizeof(T))) % 16) == 0;
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        o[i] = 0.0f;
    }
#pragma unroll 4
    for (int j = r; j < S; j += ROWS) {
        const float p = scores[j];
        const T* vp = vb + j * v_strides[2];
        if (v_vec_ok) {
            const uint4 raw = reinterpret_cast<const uint4*>(vp)[c];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                o[i] += p != 0.0f ? p * static_cast<float>(e[i]) : 0.0f;
            }
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const float x = static_cast<float>(vp[(c * VEC + i) * v_strides[3]]);
                o[i] += p != 0.0f ? p * x : 0.0f;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
        part[r][c * VEC + i] = o[i];
    }
    __syncthreads();
    if (tid < D) {
        float sum = 0.0f;
        for (int w = 0; w < ROWS; ++w) {
            sum += part[w][tid];
        }
        // out is [B, T, H, D]
        out[((b * Tq + t) * Hq + h) * D + tid] =
            static_cast<T>(total > 0.0f ? sum / total : 0.0f);
    }
"""

# Which keys a query row sees: the mask's row, or (causal) the keys up to its own slot, the
# queries being the last Tq keys.
_MASKED = (
    """
    const bool* mrow = mask + b * mask_strides[0] + t * mask_strides[2]
        + (mask_shape[1] > 1 ? h * mask_strides[1] : 0);
""",
    "mrow[j * mask_strides[3]]",
)
_CAUSAL = ("    const int causal_end = S - Tq + t;\n", "j <= causal_end")


def _compact(source: str) -> str:
    """The kernel's source without comments and indentation: MLX rebuilds the full source
    string on every call and hashes it again when it runs (custom_kernel.cpp), a host
    cost per layer that grows with its length (RESULTS SC11)."""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line)


_kernels: dict[bool, Callable] = {}
_scales: dict[float, mx.array] = {}


def _kernel(causal: bool) -> Callable:
    if causal not in _kernels:
        inputs = ["q", "k", "v", "scale_in"] + ([] if causal else ["mask"])
        setup, seen = _CAUSAL if causal else _MASKED
        _kernels[causal] = mx.fast.cuda_kernel(
            name="wedlm_small_query_attention" + ("_causal" if causal else ""),
            input_names=inputs,
            output_names=["out"],
            source=_compact(_SOURCE.replace("{SEEN_SETUP}", setup).replace("{SEEN}", seen)),
            ensure_row_contiguous=False,  # reads the KV buffers' slices in place
        )
    return _kernels[causal]


@functools.cache
def _cuda_backend() -> bool:
    cuda = getattr(mx, "cuda", None)  # absent from builds without the CUDA backend
    return cuda is not None and cuda.is_available()


def available() -> bool:
    """Whether MLX runs on CUDA here, where the kernel can run. Asked in every layer of
    every forward (a WeDLM step's host profile showed these checks, SC11), so the backend
    is asked once and only the default device each time."""
    return _cuda_backend() and mx.default_device().type == mx.gpu


def _switched_on(queries: int) -> bool:
    """WEDLM_SMALL_QUERY_ATTENTION: 0 turns the kernel off, =wide keeps one query row on
    MLX's own path (A/B of the one-row case). Read per call: A/B in one process."""
    setting = SMALL_QUERY_ATTENTION.read()
    return setting != "0" and not (setting == "wide" and queries == 1)


def enabled(queries: int = 2) -> bool:
    """Whether an attention of `queries` rows may take the kernel: on CUDA, unless the
    switch above says otherwise."""
    return _switched_on(queries) and available()


def fits(queries: mx.array, keys: mx.array, values: mx.array, mask: object) -> bool:
    """Whether the kernel takes this attention: 2-32 query rows with a bool or causal mask,
    or one row with a bool mask (AR rows of different lengths: MLX-CUDA's vector kernel
    takes no mask array, so MLX would compose the attention from separate ops); a head dim
    it unrolls; floating KV (a quantized cache goes mlx-lm's own way)."""
    if mask is None:  # one row with no mask (AR at one length): MLX's vector kernel
        return False
    b, hq, t, d = queries.shape
    _, hkv, s, dk = keys.shape
    if not 1 <= t <= s <= MAX_KEYS or t > MAX_QUERIES or d not in HEAD_DIMS or dk != d:
        return False
    dtype = queries.dtype
    if keys.dtype != dtype or values.dtype != dtype or dtype not in FLOAT_DTYPES or hq % hkv:
        return False
    if isinstance(mask, str):
        return mask == "causal" and t > 1
    return (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim == 4
        and mask.shape[0] == b
        and mask.shape[1] in (1, hq)
        and mask.shape[2:] == (t, s)
    )


def small_query_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array | str
) -> mx.array:
    """softmax(q k^T * scale, masked) v for queries [B, Hq, T, D] over keys and values
    [B, Hkv, S, D]; `mask` is [B, 1 or Hq, T, S] bool or "causal" (the queries are the last
    T keys). Returns [B, Hq, T, D] (a transposed view of a [B, T, Hq, D] result)."""
    b, hq, t, d = queries.shape
    causal = isinstance(mask, str)
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    inputs = [queries, keys, values, _scales[scale]] + ([] if causal else [mask])
    (out,) = _kernel(causal)(
        inputs=inputs,
        template=[("T", queries.dtype), ("D", d), ("THREADS", THREADS), ("MAX_KEYS", MAX_KEYS)],
        grid=(b * hq * t * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, t, hq, d)],
        output_dtypes=[queries.dtype],
    )
    return out.transpose(0, 2, 1, 3)


def with_small_query_attention(attention: Callable) -> Callable:
    """mlx-lm's `scaled_dot_product_attention`, sending what fits to the kernel."""

    def attend(queries, keys, values, cache, scale, mask, sinks=None):
        plain = sinks is None and not hasattr(cache, "bits") and available()  # CPU: no checks
        if plain and fits(queries, keys, values, mask) and _switched_on(queries.shape[2]):
            return small_query_attention(queries, keys, values, scale, mask)
        return attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    attend.wraps = attention  # type: ignore[attr-defined]
    return attend


def install(family: ModuleType) -> None:
    """Route an mlx-lm model family's attention through `with_small_query_attention`.
    The family module imported mlx-lm's function by name, so that name is what is
    replaced; the wrapper passes everything it does not take to the original."""
    current = getattr(family, "scaled_dot_product_attention", None)
    if current is None or hasattr(current, "wraps"):
        return
    family.scaled_dot_product_attention = with_small_query_attention(current)
