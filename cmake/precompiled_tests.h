// The headers of the GoogleTest suite (tests/cpp), precompiled once for posenc_tests
// (CMakeLists.txt, POSENC_PRECOMPILE_HEADERS): every test file includes <torch/torch.h>,
// which alone takes about half of their compile time.
#pragma once
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/library.h>
#include <torch/torch.h>
