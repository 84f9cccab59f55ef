// CPU kernel of rope_append_kv. Tokens are spread over threads (at::parallel_for); each
// token's cos/sin are computed once (rope_rows.h, RoPE's own pieces) and serve every head of
// q and k: q rotated into its output, k rotated straight into its cache row (and into the
// returned k when asked), v copied into its cache row. One read of q, k, v; one write of q and
// of each cache row.
#include "ops/rope_append_kv/cpu/kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN
namespace {

// v's row into its cache row; with `stream`, streaming stores where the rows allow them
// (rope_rows.h: row_streams, rows_can_stream).
template <typename scalar_t>
void copy_row(const scalar_t* in, int64_t si, scalar_t* out, int64_t so, int64_t n, bool stream) {
  if (si != 1 || so != 1) {
    for (int64_t j = 0; j < n; ++j) out[j * so] = in[j * si];
    return;
  }
  // A row of n elements as a "rotary_dim" of 2n: its start aligned and n * sizeof a multiple
  // of 32 bytes, so the loop below covers the row in whole vectors.
  if (row_streams(stream, in, out) && rows_can_stream<scalar_t>(out, 2 * n)) {
    using Vec = Vectorized<scalar_t>;
    for (int64_t j = 0; j < n; j += Vec::size()) store_vec<true>(Vec::loadu(in + j), out + j);
    return;
  }
  std::memcpy(out, in, n * sizeof(scalar_t));
}

template <typename scalar_t>
void rope_append_kv_tokens(const KvCacheArgs& a) {
  using acc_t = at::opmath_type<scalar_t>;
  const RopeArgs& r = a.rope;
  const int64_t row_elems =
      std::max<int64_t>(1, (r.q.heads + 2 * r.k.heads) * std::max(r.head_dim, a.v_head_dim));
  // About 64k elements per task: a decode step (a few tokens) runs on the calling thread,
  // where waking the pool would cost more than the work.
  const int64_t grain = std::max<int64_t>(1, 65536 / row_elems);
  const auto* q_in = static_cast<const scalar_t*>(r.q.in);
  auto* q_out = static_cast<scalar_t*>(r.q.out);
  const auto* k_in = static_cast<const scalar_t*>(r.k.in);
  auto* k_out = static_cast<scalar_t*>(r.k.out);
  const auto* v_in = static_cast<const scalar_t*>(a.v);
  auto* kc = static_cast<scalar_t*>(a.k_cache);
  auto* vc = static_cast<scalar_t*>(a.v_cache);

  const int64_t tokens = r.batch * r.seq;
  const int64_t written = tokens * static_cast<int64_t>(sizeof(scalar_t)) *
                          (r.q.heads * r.head_dim + r.k.heads * (r.head_dim + a.v_head_dim));
  // A large call streams its cache rows; q's rows only out of place (rotate_row asks
  // row_streams: in place, q's lines were just loaded).
  const bool stream = written >= kStreamBytes;
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    TokenAngles<acc_t> angles;
    int64_t pos[math::kRopeMaxAxes];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / r.seq, s = item % r.seq;
      token_positions(r, b, s, pos);  // no packed sequences here: always a position
      token_angles<acc_t>(r, pos, angles);
      for (int64_t h = 0; h < r.q.heads; ++h) {
        const int64_t* si = r.q.in_stride;
        const int64_t* so = r.q.out_stride;
        rotate_row<scalar_t, acc_t>(r, q_in + b * si[0] + s * si[1] + h * si[2], si[3],
                                    q_out + b * so[0] + s * so[1] + h * so[2], so[3], angles,
                                    stream);
      }
      int64_t outer = 0, inner = 0;
      const bool cached = kv_cache_row(a, b, s, &outer, &inner);
      for (int64_t h = 0; h < r.k.heads; ++h) {
        const int64_t* si = r.k.in_stride;
        const scalar_t* k_row = k_in + b * si[0] + s * si[1] + h * si[2];
        if (cached) {
          const int64_t* sc = a.k_cache_stride;
          rotate_row<scalar_t, acc_t>(r, k_row, si[3], kc + outer * sc[0] + inner * sc[1] + h * sc[2],
                                      sc[3], angles, stream);
        }
        if (a.write_k) {
          const int64_t* so = r.k.out_stride;
          rotate_row<scalar_t, acc_t>(r, k_row, si[3], k_out + b * so[0] + s * so[1] + h * so[2],
                                      so[3], angles);
        }
        if (cached) {
          const int64_t* sv = a.v_stride;
          const int64_t* sc = a.v_cache_stride;
          copy_row(v_in + b * sv[0] + s * sv[1] + h * sv[2], sv[3],
                   vc + outer * sc[0] + inner * sc[1] + h * sc[2], sc[3], a.v_head_dim, stream);
        }
      }
    }
    if (stream) stream_fence();  // before this thread's part is handed back
  });
}

void rope_append_kv_kernel(const KvCacheArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_rope_append_kv_cpu", [&](auto* tag) {
    rope_append_kv_tokens<std::remove_pointer_t<decltype(tag)>>(a);
  });
}

}  // namespace
POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(rope_append_kv_stub, &rope_append_kv_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
