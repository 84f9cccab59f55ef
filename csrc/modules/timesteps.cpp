// posenc::Timesteps: diffusers' Timesteps module over the timestep_embedding op, the one
// definition behind posenc.Timesteps (Python) too.
#include <torch/nn/module.h>

#include <ostream>

#include "posenc/functional.h"
#include "posenc/modules.h"

namespace posenc {

TimestepsImpl::TimestepsImpl(const TimestepsOptions& options_) : options(options_) { reset(); }

void TimestepsImpl::reset() {
  // The op checks the settings (with its messages): on no timesteps, so that bad options
  // fail here rather than at the first forward.
  forward(torch::empty({0}));
}

void TimestepsImpl::pretty_print(std::ostream& stream) const {
  stream << "posenc::Timesteps(num_channels=" << options.num_channels()
         << ", flip_sin_to_cos=" << (options.flip_sin_to_cos() ? "true" : "false")
         << ", downscale_freq_shift=" << options.downscale_freq_shift()
         << ", scale=" << options.scale() << ", max_period=" << options.max_period() << ")";
}

torch::Tensor TimestepsImpl::forward(const torch::Tensor& timesteps) {
  return timestep_embedding(timesteps, options.num_channels(), options.max_period(),
                            options.flip_sin_to_cos(), options.downscale_freq_shift(),
                            options.scale());
}

}  // namespace posenc
