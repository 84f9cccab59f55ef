// The torch headers that nearly every C++ translation unit of posenc includes, compiled once
// per target into a precompiled header (CMakeLists.txt, POSENC_PRECOMPILE_HEADERS). Parsing
// them is most of a translation unit's compile time (two thirds of a small unit's). Only
// headers that every unit may see: they are included ahead of each unit's own includes, so
// nothing here may depend on a macro that a unit defines. <torch/torch.h> is left out: a
// precompiled header that large made the small units slower (16 s instead of 5 s for
// rope_checks.cpp) than parsing it where it is needed.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>
