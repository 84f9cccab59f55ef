// CPU kernel of the rope ops. Tokens are spread over threads with at::parallel_for; each
// token's cos/sin (one per pair, from the position on the pair's axis) are computed once
// with the shared math of posenc/math/rope.h and reused for every head of q and k (and for every batch row when
// all rows share their positions). Rows whose last dimension is
// contiguous take an at::vec path (half precision widened to float32); the rest a scalar
// loop. The rotation is done in float32 (float64 for float64) and rounded once. A call that
// writes kStreamBytes or more out of place uses streaming stores (rope_rows.h); in place,
// each line is in the cache already (it was just read), so plain stores.
#include "ops/rope/cpu/kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "ops/common/cpu/rope_rows.h"  // the per-token and per-row pieces

namespace posenc {
namespace ops {
namespace cpu {
POSENC_ISA_NAMESPACE_BEGIN

template <typename scalar_t>
void rope_tokens(const RopeArgs& a) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t row_elems = std::max<int64_t>(1, (a.q.heads + a.k.heads) * a.head_dim);
  // When every batch row sees the same positions (no per-row positions, offsets or packing),
  // work goes by sequence index s and the angles of s serve all batch rows.
  const bool shared = a.cu_seqlens == nullptr && a.cu_seqlens32 == nullptr && a.offsets == nullptr &&
                      (a.positions == nullptr || a.positions_batch_stride == 0);
  const int64_t per_item = shared ? a.batch : 1;
  const int64_t items = shared ? a.seq : a.batch * a.seq;
  // About 32k elements per task: large enough to amortise the per-token angles.
  const int64_t grain = std::max<int64_t>(1, 32768 / (row_elems * std::max<int64_t>(per_item, 1)));
  const bool in_place = a.q.out == a.q.in;
  const int64_t written = a.batch * a.seq * row_elems * static_cast<int64_t>(sizeof(scalar_t));
  const bool stream = !in_place && written >= kStreamBytes;

  auto rotate_token = [&](int64_t b, int64_t s, bool valid, const TokenAngles<acc_t>& angles) {
    for (const RopeOperand* op : {&a.q, &a.k}) {
      const auto* in = static_cast<const scalar_t*>(op->in);
      auto* out = static_cast<scalar_t*>(op->out);
      const bool gaps = rows_have_gaps(op->in_stride[2], op->in_stride[3], a.head_dim);
      for (int64_t h = 0; h < op->heads; ++h) {
        const scalar_t* in_row =
            in + b * op->in_stride[0] + s * op->in_stride[1] + h * op->in_stride[2];
        scalar_t* out_row =
            out + b * op->out_stride[0] + s * op->out_stride[1] + h * op->out_stride[2];
        if (gaps) prefetch_row_ahead(in_row, op->in_stride[2], a.head_dim, in_place);
        if (valid) {
          rotate_row<scalar_t, acc_t>(a, in_row, op->in_stride[3], out_row, op->out_stride[3],
                                      angles, stream);
        } else {
          nan_row(a, out_row, op->out_stride[3]);
        }
      }
    }
  };

  // Blocks of tokens whose angles are computed once, walked in memory order:
  //  - layouts whose heads lie further apart than their tokens ("bhsd": each head's rows are
  //    one contiguous run over the sequence): token by token, every head's row is a stream
  //    of its own, dozens of streams 256 KiB apart that the prefetchers cannot follow. There
  //    a task walks each head's rows of the block (32-128 tokens: walk_block);
  //  - token-major layouts whose batch rows share their positions: token by token, the angles
  //    of s serve every batch row, but then a task reads and writes one stream per batch row
  //    and operand at once (8 read and 8 written for q and k of 4 rows); there a task walks
  //    the block's kBlock tokens of one batch row, then of the next (float32 "bshd" (4, 1024, 16/4,
  //    128): in place 1.25 -> 0.87 ms, out of place 1.45 -> 1.18; bfloat16 in place 0.9x:
  //    benchmarks/NOTES.md).
  // Same angles, same rotation per row: the same bits. The head walk prefetches the row it
  // reaches kWalkAhead rows on (prefetch_walk_ahead): a head's block is a run of 16-64 KiB,
  // and the hardware prefetchers neither cross its 4 KiB pages nor know where the next
  // head's run starts (float32 and bfloat16, in place and out: 0.75-0.79x, benchmarks/NOTES.md).
  constexpr int64_t kBlock = kWalkBlock;
  const bool heads_outer = a.q.in_stride[1] < a.q.in_stride[2] && a.q.heads + a.k.heads > 1 && a.seq > 1;
  // (The token-major blocks only where every thread gets two of them at least.)
  const bool batch_blocks = shared && a.batch > 1 && a.seq >= 2 * kBlock * at::get_num_threads();
  if (heads_outer || batch_blocks) {
    const int64_t block =
        heads_outer ? walk_block<scalar_t>(a.seq, shared ? 1 : a.batch, at::get_num_threads()) : kBlock;
    const int64_t blocks = (a.seq + block - 1) / block;
    const int64_t units = shared ? blocks : a.batch * blocks;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<TokenAngles<acc_t>[]> angles(new TokenAngles<acc_t>[block]);
      bool valid[kMaxWalkBlock];
      int64_t pos[math::kRopeMaxAxes];
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b0 = shared ? 0 : unit / blocks;
        const int64_t s0 = (unit % blocks) * block, s1 = std::min(a.seq, s0 + block);
        for (int64_t s = s0; s < s1; ++s) {
          valid[s - s0] = token_positions(a, b0, s, pos) || shared;
          if (valid[s - s0]) token_angles<acc_t>(a, pos, angles[s - s0]);
        }
        const int64_t b_end = shared ? a.batch : b0 + 1;
        for (int64_t b = b0; b < b_end; ++b) {
          if (!heads_outer) {
            for (int64_t s = s0; s < s1; ++s) rotate_token(b, s, valid[s - s0], angles[s - s0]);
            continue;
          }
          for (const RopeOperand* op : {&a.q, &a.k}) {
            const auto* in = static_cast<const scalar_t*>(op->in);
            auto* out = static_cast<scalar_t*>(op->out);
            for (int64_t h = 0; h < op->heads; ++h) {
              for (int64_t s = s0; s < s1; ++s) {
                prefetch_walk_ahead(in + b * op->in_stride[0], op->in_stride[1], op->in_stride[2], h, s, s0, s1,
                                    a.head_dim, in == out);
                const scalar_t* in_row = in + b * op->in_stride[0] + s * op->in_stride[1] + h * op->in_stride[2];
                scalar_t* out_row = out + b * op->out_stride[0] + s * op->out_stride[1] + h * op->out_stride[2];
                if (valid[s - s0]) {
                  rotate_row<scalar_t, acc_t>(a, in_row, op->in_stride[3], out_row, op->out_stride[3],
                                              angles[s - s0], stream);
                } else {
                  nan_row(a, out_row, op->out_stride[3]);
                }
              }
            }
          }
        }
      }
      if (stream) stream_fence();
    });
    return;
  }

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    TokenAngles<acc_t> angles;
    int64_t pos[math::kRopeMaxAxes];
    for (int64_t item = begin; item < end; ++item) {
      if (shared) {
        token_positions(a, 0, item, pos);
        token_angles<acc_t>(a, pos, angles);
        for (int64_t b = 0; b < a.batch; ++b) rotate_token(b, item, true, angles);
      } else {
        const int64_t b = item / a.seq, s = item % a.seq;
        const bool valid = token_positions(a, b, s, pos);
        if (valid) token_angles<acc_t>(a, pos, angles);
        rotate_token(b, s, valid, angles);
      }
    }
    if (stream) stream_fence();  // before this thread's part is handed back
  });
}

template void rope_tokens<float>(const RopeArgs&);
template void rope_tokens<double>(const RopeArgs&);
template void rope_tokens<c10::Half>(const RopeArgs&);
template void rope_tokens<c10::BFloat16>(const RopeArgs&);

namespace {
void rope_kernel(const RopeArgs& a, c10::ScalarType dtype) {
  dispatch_floating(dtype, "posenc_rope_cpu", [&](auto* tag) {
    rope_tokens<std::remove_pointer_t<decltype(tag)>>(a);
  });
}
}  // namespace

POSENC_ISA_NAMESPACE_END

POSENC_REGISTER_DISPATCH(rope_stub, &rope_kernel)

}  // namespace cpu
}  // namespace ops
}  // namespace posenc
